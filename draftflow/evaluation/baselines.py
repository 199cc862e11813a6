"""Train-free speculation in vLLM that a drafter must beat (``evaluation.must_beat``).

Each baseline is the target served with a ``--speculative-config`` that needs no trained model;
it drafts as many tokens per step as the drafter (k, the drafter's served speculative tokens):

- ``ngram``: prompt lookup, the next tokens after the latest earlier match of the last 2 to 4
  tokens (strong where the output copies its input: summaries, edits, code);
- ``suffix``: suffix decoding (Arctic Inference), matching against the prompt and earlier
  outputs; vLLM needs the ``arctic_inference`` package for it.

The evaluation decodes them as extra sides of the drafter's and the target's speed rounds
(:func:`draftflow.evaluation.in_vllm.evaluate_in_vllm`), and the gate refuses a drafter whose
speed-up does not exceed each one's (:meth:`draftflow.evaluation.report.Evaluation.gate_failures`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence

BASELINES: dict[str, Callable[[int], dict]] = {
    "ngram": lambda k: {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
    "suffix": lambda k: {"method": "suffix", "num_speculative_tokens": k},
}

# what each baseline needs importable in the virtualenv that runs vLLM: (module, package to install)
REQUIRES: dict[str, tuple[str, str]] = {"suffix": ("arctic_inference", "arctic-inference")}


class BaselineUnavailable(RuntimeError):
    """A baseline of ``evaluation.must_beat`` cannot run in the vLLM virtualenv."""


def baseline_configs(names: Sequence[str], k: int) -> dict[str, dict]:
    """{name: vLLM ``--speculative-config``} for the named baselines, drafting ``k`` tokens."""
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ValueError(
            f"evaluation.must_beat: unknown baseline(s) {unknown} (known: {', '.join(BASELINES)})"
        )
    return {n: BASELINES[n](int(k)) for n in names}


def check_available(names: Sequence[str], python: str, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`BaselineUnavailable` (one line) when a baseline's package is not importable by
    ``python`` (the vLLM virtualenv's interpreter, with ``env`` added as the launcher adds it)."""
    for name in names:
        if name not in REQUIRES:
            continue
        module, package = REQUIRES[name]
        if not _importable(python, module, dict(env or {})):
            raise BaselineUnavailable(
                f"evaluation.must_beat: {name} needs the {module} package in the vLLM virtualenv "
                f"({python}), and it is not importable there: `scripts/bootstrap.sh --with-suffix` "
                f"builds it into draftflow's vLLM virtualenv (elsewhere: `pip install {package}` "
                f"into the virtualenv that runs vLLM), or drop {name} from evaluation.must_beat"
            )


def _importable(python: str, module: str, env: dict[str, str]) -> bool:
    probe = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, timeout=120, env={**os.environ, **env}, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0
