"""Charts are drawn inside Prefect task threads, several at a time: they use matplotlib's Figure API,
which keeps no global state, never pyplot (its figure registry and current figure are process-wide
and not thread-safe).

pyplot's races do not show on demand, so the check is twofold, in a fresh interpreter: charts drawn
from eight threads at once come out byte-identical to the same charts drawn one by one, and
drawing them never imports ``matplotlib.pyplot`` at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import hashlib, json, sys, threading
    from pathlib import Path

    from draftflow.evaluation.report import AcceptanceReport, acceptance_chart
    from draftflow.train.curves import plot_training_curves

    out = Path(sys.argv[1])

    def draw(i: int, folder: Path) -> None:
        k = 2 + i % 5
        accepted = [max(0, 40 - (7 + i) * j) for j in range(k)]
        reports = [
            AcceptanceReport(
                source=source, drafter="dflash", draft_length=k, num_prompts=2, drafts=50,
                draft_tokens=50 * k, accepted_tokens=sum(accepted), accepted_per_position=accepted,
            )
            for source in ("offline", "vllm")[: 1 + i % 2]
        ]
        acceptance_chart(reports, folder / f"acceptance-{i}.png")
        records = [{"step": s, "loss": 5.0 / (s + i)} for s in range(1, 40)]
        records += [{"step": s, "val_tau": 1.0 + s / (50.0 + i)} for s in range(5, 40, 5)]
        plot_training_curves(records, str(folder / f"curves-{i}.png"), best_step=35 if i % 2 else None)

    def digests(folder: Path) -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    serial, threaded = out / "serial", out / "threaded"
    serial.mkdir()
    threaded.mkdir()
    for i in range(8):
        draw(i, serial)
    start = threading.Barrier(8)
    errors = []

    def run(i: int) -> None:
        start.wait()
        try:
            for _ in range(3):
                draw(i, threaded)
        except BaseException as err:
            errors.append(repr(err))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({
        "errors": errors,
        "serial": digests(serial),
        "threaded": digests(threaded),
        "pyplot_imported": "matplotlib.pyplot" in sys.modules,
    }))
    """
)


@pytest.mark.slow
def test_charts_drawn_from_many_threads_are_exact_and_never_touch_pyplot(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert len(result["serial"]) == 16
    assert result["threaded"] == result["serial"]  # every chart as drawn alone
    assert result["pyplot_imported"] is False
