"""The best validation step's weights (RUN/best/) survive a crash while they are rewritten, and a torn
or dangling best.json never stops a resume or an export: the last good best is used, with a warning."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftflow.paths import RunLayout, is_temp_name
from draftflow.train.monitor import Best, Monitor, _write_best, load_best
from draftflow.train.runtime import Runtime


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 64, bias=False)  # 16 KiB of fp32 weights


def _monitor(layout: RunLayout) -> Monitor:
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return Monitor(
        layout=layout,
        runtime=runtime,
        source=None,
        draft_length=3,
        target_model="",
        last_layer=None,
        context_layers=(),
        validation_ids=[],
        board=False,
    )


def _records(*bests: tuple[int, float]) -> list[dict]:
    return [{"step": s, "val_tau": t, "best_step": s, "best_val_tau": t} for s, t in bests]


@pytest.mark.slow
def test_a_crash_while_rewriting_the_best_weights_keeps_the_previous_best_whole(tmp_path):
    """A resumed run validates step 4 again and rewrites its best weights; the process dies in the middle
    of that write (the kernel's file-size limit kills it with SIGXFSZ, as a kill -9 or a full disk would
    stop it). best.json names step 4: its weights must still be the earlier, whole ones."""
    layout = RunLayout(str(tmp_path / "run"))
    first = _model(0)
    _write_best(layout, first, Best(4, 1.5, layout.best_weights(4)))
    child = textwrap.dedent(
        f"""
        import resource, torch
        from draftflow.paths import RunLayout
        from draftflow.train.monitor import Best, _write_best
        torch.manual_seed(1)
        model = torch.nn.Linear(64, 64, bias=False)
        layout = RunLayout({layout.root!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the 16 KiB weights cannot be written
        _write_best(layout, model, Best(4, 1.7, layout.best_weights(4)))
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, "the write was expected to be cut off by the file-size limit"

    best_dir = Path(layout.best_dir)
    for path in best_dir.iterdir():
        if path.suffix == ".safetensors" and not is_temp_name(path.name):
            load_file(path)  # every weights file under its final name is whole
    restored = _model(2)
    best = load_best(layout, restored)
    assert best is not None and (best.step, best.tau) == (4, 1.5)
    torch.testing.assert_close(restored.weight, first.weight, rtol=0, atol=0)


def test_a_torn_best_json_falls_back_to_the_last_good_best_with_a_warning(tmp_path, capsys):
    layout = RunLayout(str(tmp_path / "run"))
    model = _model(0)
    _write_best(layout, model, Best(4, 1.5, layout.best_weights(4)))
    record = Path(layout.best_record)
    record.write_bytes(record.read_bytes()[:17])  # a best.json cut off mid-write (an older trainer)

    monitor = _monitor(layout)
    monitor.start(6, _records((2, 1.2), (4, 1.5)))  # resume at step 6: must not crash
    assert monitor.best == Best(4, 1.5, layout.best_weights(4)), "the metrics name the last good best"
    assert "best.json" in capsys.readouterr().err

    restored = _model(3)
    best = load_best(layout, restored)  # the export after this resume uses that best
    assert best is not None and best.step == 4
    torch.testing.assert_close(restored.weight, model.weight, rtol=0, atol=0)


def test_a_best_json_naming_missing_weights_neither_stops_resume_nor_export(tmp_path, capsys):
    layout = RunLayout(str(tmp_path / "run"))
    Path(layout.best_dir).mkdir(parents=True)
    Path(layout.best_record).write_text(json.dumps(Best(6, 1.9, layout.best_weights(6)).as_dict()))

    monitor = _monitor(layout)
    monitor.start(8, _records((6, 1.9)))
    assert monitor.best is None, "no weights of any best survive: none is claimed"
    assert load_best(layout, _model(0)) is None  # the export falls back to the last step's weights
    err = capsys.readouterr().err
    assert "step-00000006.safetensors" in err, err


def test_only_the_newest_best_weights_are_kept_and_a_torn_best_json_is_replaced(tmp_path):
    layout = RunLayout(str(tmp_path / "run"))
    Path(layout.best_dir).mkdir(parents=True)
    Path(layout.best_record).write_text('{"step": 2, "val_t')  # torn
    orphan = Path(layout.best_weights(3))  # weights written, then killed before best.json named them
    orphan.write_bytes(b"partial")
    _write_best(layout, _model(0), Best(5, 1.4, layout.best_weights(5)))
    assert json.loads(Path(layout.best_record).read_text())["step"] == 5
    assert sorted(p.name for p in Path(layout.best_dir).iterdir()) == [
        "best.json",
        "step-00000005.safetensors",
    ]
