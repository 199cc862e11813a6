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
