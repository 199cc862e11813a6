"""Architecture rules that keep the codebase readable: one-way imports, small modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _py_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def test_core_never_imports_prefect_or_the_layers_above_it():
    offenders = {
        str(p.relative_to(REPO)): sorted(_imports(p) & {"prefect", "tasks", "flows", "blocks"})
        for p in _py_files("draftflow")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_tasks_never_import_flows():
    offenders = [str(p.relative_to(REPO)) for p in _py_files("tasks") if "flows" in _imports(p)]
    assert offenders == []


def _calls(path: Path) -> set[str]:
    """`Name.attr(...)` and `name(...)` calls of a module, as written."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                found.add(f"{f.value.id}.{f.attr}")
            elif isinstance(f, ast.Name):
                found.add(f.id)
    return found


RECIPE_READERS = {"Plan.load", "load_recipe", "read_yaml", "validate", "RunRef", "RunRef.create"}


def test_one_run_reference_per_flow_run_made_in_one_place():
    """Tasks and flows take the run reference (draftflow.run_ref) the flow's first task made; only
    tasks/infra.py makes it, and nothing in tasks/ or flows/ reads a recipe by itself."""
    made_here = {REPO / "tasks" / "infra.py"}
    not_a_flow_run = {REPO / "flows" / "deploy.py"}  # reads recipes to build deployments
    offenders = {
        str(p.relative_to(REPO)): sorted(_calls(p) & RECIPE_READERS)
        for p in _py_files("tasks") + _py_files("flows")
        if p not in made_here | not_a_flow_run
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert _calls(REPO / "tasks" / "infra.py") & RECIPE_READERS == {"RunRef.create"}


def test_cpu_connector_imports_only_vllm_torch_and_stdlib():
    path = REPO / "draftflow" / "vllm" / "cpu_connector.py"
    if not path.exists():
        return  # the connector arrives with the extraction work; its own tests cover it
    allowed = {"vllm", "torch", "__future__"} | set(sys.stdlib_module_names)
    assert _imports(path) - allowed == set()


def test_modules_stay_small():
    big = {
        str(p.relative_to(REPO)): n
        for folder in ("draftflow", "tasks", "flows", "blocks", "bench")
        for p in _py_files(folder)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert big == {}


DRAFTER_KINDS = {"dflash", "eagle3"}
DRAFTER_CLASSES = {"DFlashDrafter", "Eagle3Drafter", "DFlash", "Eagle3"}
# Where kinds are declared: the models package (one folder per kind, its recipe section included).
KIND_DECLARATIONS = ("draftflow/models/",)


def _kind_branches(path: Path) -> list[str]:
    """Comparisons with a kind name, dicts keyed by kind names, isinstance on a drafter class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op in operands:
                elts = op.elts if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [op]
                if any(isinstance(e, ast.Constant) and e.value in DRAFTER_KINDS for e in elts):
                    found.append(f"line {node.lineno}: compares with a drafter kind")
        elif isinstance(node, ast.Dict):
            if any(isinstance(k, ast.Constant) and k.value in DRAFTER_KINDS for k in node.keys):
                found.append(f"line {node.lineno}: a dict keyed by drafter kind")
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant):
            if node.value.value in DRAFTER_KINDS:
                found.append(f"line {node.lineno}: matches a drafter kind")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "isinstance"
            and len(node.args) == 2
        ):
            names = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            if names & DRAFTER_CLASSES:
                found.append(f"line {node.lineno}: isinstance on a drafter class")
    return found


def test_only_models_knows_drafter_kinds_apart():
    """Trainer, evaluator, contract check, export and publishing call the algorithm object of
    :mod:`draftflow.models`; none of them branches on which kind it is."""
    offenders = {}
    for folder in ("draftflow", "tasks", "flows", "blocks"):
        for p in _py_files(folder):
            rel = p.relative_to(REPO).as_posix()
            if rel.startswith(KIND_DECLARATIONS):
                continue
            if found := _kind_branches(p):
                offenders[rel] = found
    assert offenders == {}


def test_the_kind_rule_catches_a_branch(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        'if spec.kind == "eagle3":\n    pass\nkeys = {"dflash": 1}\nok = isinstance(m, DFlashDrafter)\n'
    )
    assert len(_kind_branches(sample)) == 3
