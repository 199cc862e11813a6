"""The drafter kinds: found where they live, never listed.

A kind is one package holding at least

- ``section``: its recipe section, a :class:`~draftflow.recipe.section.DrafterSection` subclass
  whose ``kind: Literal["name"]`` names the kind (pydantic only, so recipes validate without torch);
- ``algorithm``: its :class:`~draftflow.models.algorithm.DrafterAlgorithm` subclass, decorated
  with ``@drafter_kind(section=ItsSection)``;

and whatever model code those use. The kinds are every subpackage of :mod:`draftflow.models`
with a ``section`` module, plus every entry point of the group ``draftflow.drafters`` (name: the
kind, value: its package) of an installed distribution, for kinds that live outside draftflow::

    [project.entry-points."draftflow.drafters"]
    mykind = "mypackage.mykind"

Nothing is imported before it is asked for: the kinds and their sections on the first call that
needs them (section modules only), a kind's ``algorithm`` module on its first
:func:`algorithm_class`. Standard library only at import: the model code (``bench/gpu.py``) and
the recipe schema both import this module.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
from dataclasses import dataclass

GROUP = "draftflow.drafters"

_CLASSES: dict[str, type] = {}  # filled by @drafter_kind as algorithm modules are imported


class UnknownDrafterKind(ValueError):
    """A kind no package provides."""


@dataclass(frozen=True)
class Kind:
    name: str
    package: str
    section: type  # a DrafterSection subclass


def drafter_kind(*, section: type):
    """Class decorator: the :class:`~draftflow.models.algorithm.DrafterAlgorithm` of the kind that
    ``section`` names; sets the class's ``kind`` (a ``kind`` it declares must be the same)."""
    kind = section.kind_name()

    def register(cls: type) -> type:
        declared = cls.__dict__.get("kind", kind)
        if declared != kind:
            raise TypeError(f"{cls.__qualname__}.kind is {declared!r} but its section names {kind!r}")
        known = _CLASSES.get(kind)
        if known is not None and _qualified(known) != _qualified(cls):  # the same class reloaded is fine
            raise TypeError(f"drafter kind {kind!r}: both {_qualified(known)} and {_qualified(cls)}")
        cls.kind = kind
        _CLASSES[kind] = cls
        return cls

    return register


def kinds() -> list[str]:
    """Every kind's name, sorted."""
    return list(_found())


def sections() -> dict[str, type]:
    """kind → its recipe section class, by kind name."""
    return {name: found.section for name, found in _found().items()}


def algorithm_class(kind: str | None):
    """The :class:`~draftflow.models.algorithm.DrafterAlgorithm` subclass of ``kind``."""
    found = _kind(kind)
    importlib.import_module(f"{found.package}.algorithm")  # its @drafter_kind registers the class
    cls = _CLASSES.get(found.name)
    if cls is None:
        raise LookupError(
            f"{found.package}.algorithm defines no class decorated with "
            f"@drafter_kind(section={found.section.__name__})"
        )
    return cls


def lazy_getattr(package: str, names: dict[str, str], modules: tuple[str, ...]):
    """A kind package's module ``__getattr__``: its modules and names (name → module) imported on
    first use, so a recipe imports only ``section`` and the model code only ``config``/``model``."""

    def __getattr__(name: str):
        if name in modules:
            return importlib.import_module(f"{package}.{name}")
        if name in names:
            return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def rescan() -> None:
    """Forget the kinds found so far: the next call looks again (a kind installed into a running
    process, a test's plugin removed from ``sys.path``)."""
    _found.cache_clear()


def _kind(kind: str | None) -> Kind:
    found = _found()
    if kind not in found:
        raise UnknownDrafterKind(f"unknown drafter kind {kind!r}; known: {', '.join(map(repr, found))}")
    return found[kind]


@functools.cache
def _found() -> dict[str, Kind]:
    out: dict[str, Kind] = {}
    for package, claimed in [*((p, None) for p in _builtin_packages()), *_entry_point_packages()]:
        section = _section_of(package)
        name = section.kind_name()
        if claimed is not None and claimed != name:
            raise ValueError(
                f"entry point {claimed} = {package} in group {GROUP}: its section names {name!r}"
            )
        if name in out and out[name].package != package:
            raise ValueError(f"drafter kind {name!r} is in both {out[name].package} and {package}")
        out[name] = Kind(name, package, section)
    return dict(sorted(out.items()))


def _builtin_packages() -> list[str]:
    import draftflow.models as models

    found = []
    for info in pkgutil.iter_modules(models.__path__):
        if not info.ispkg:
            continue
        # Looked up without importing the package: only a kind's section is imported here.
        spec = info.module_finder.find_spec(info.name, None)
        locations = (spec and spec.submodule_search_locations) or []
        if any(sub.name == "section" for sub in pkgutil.iter_modules(locations)):
            found.append(f"{models.__name__}.{info.name}")
    return found


def _entry_point_packages() -> list[tuple[str, str]]:
    found = []
    for point in importlib.metadata.entry_points(group=GROUP):
        if point.attr:
            raise ValueError(f"entry point {point.name} = {point.value} in group {GROUP}: name a package")
        found.append((point.module, point.name))
    return found


def _section_of(package: str) -> type:
    from draftflow.recipe.section import DrafterSection  # pydantic: only once a kind is looked up

    module = importlib.import_module(f"{package}.section")
    defined = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, DrafterSection)
        and value.__module__ == module.__name__
    ]
    if len(defined) != 1:
        raise TypeError(f"{module.__name__} defines {len(defined)} drafter sections; a kind's defines one")
    return defined[0]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
