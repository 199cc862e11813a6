"""Fault trials for the trainer: kill -9 during training, and torn checkpoints.

    .venv/bin/python bench/train_faults.py --kills 10 --torn 5      # builds a small store first

A small SmolLM2 store (the trainer tests' recipe: 44 chatterbot samples, DFlash, 1 layer)
is filled once in a temporary folder. One uninterrupted run gives the reference weights.

* kill -9: one run id is started again and again and killed with SIGKILL after a random
  delay once training has begun, `--kills` times; then run to the end. Lost = steps of the
  final run's plan never trained (the step count differs from the reference), duplicated =
  steps logged twice in metrics.jsonl after the truncation on resume, corrupt = complete
  checkpoints whose files do not match their checksums. The final weights must equal the
  reference's (rtol 1e-5): resuming from a checkpoint is exact.
* torn: a run stops after a random number of steps; one random file of its newest
  checkpoint is truncated or has a byte flipped; the run is resumed to the end. It must fall
  back to the previous checkpoint and end with the reference's weights.

Prints one JSON line per fault class. No timing is measured here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draftflow.results import TrainResult

REPO = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "draftflow.train"]
SETTINGS = ["--set", "training.checkpoint_every=2", "--set", "training.epochs=2"]


def _fixtures():
    spec = importlib.util.spec_from_file_location(
        "train_store_fixtures", REPO / "tests" / "train" / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _run(recipe: str, run_id: str, *extra: str) -> TrainResult:
    from draftflow.results import TrainResult

    proc = subprocess.run(  # noqa: PLW1510 - the exit code is checked below
        TRAIN + [recipe, "--run-id", run_id, *SETTINGS, *extra],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{run_id}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return TrainResult.from_output(proc.stdout.splitlines())


def _same_weights(a: str, b: str) -> bool:
    import torch
    from safetensors.torch import load_file

    from draftflow.paths import EXPORT_WEIGHTS

    x, y = load_file(Path(a) / EXPORT_WEIGHTS), load_file(Path(b) / EXPORT_WEIGHTS)
    return x.keys() == y.keys() and all(torch.allclose(x[k], y[k], rtol=1e-5, atol=1e-6) for k in x)


def _audit(result: TrainResult, reference: TrainResult) -> dict:
    from draftflow.paths import RunLayout
    from draftflow.train import checkpointing

    layout = RunLayout(result.run_dir)
    corrupt = 0
    for step in checkpointing.marked_steps(layout):
        try:
            checkpointing.read_verified(layout.checkpoint(step))
        except checkpointing.TornCheckpoint:
            corrupt += 1
    steps = [json.loads(ln)["step"] for ln in Path(layout.metrics).read_text().splitlines() if ln.strip()]
    return {
        "lost_steps": reference.steps - result.steps,
        "duplicated_steps": len(steps) - len(set(steps)),
        "corrupt_checkpoints": corrupt,
        "weights_equal_reference": _same_weights(result.export_dir, reference.export_dir),
    }


def kill_trials(recipe: str, reference: dict, kills: int, rng: random.Random) -> dict:
    from draftflow.train.metrics import parse_line

    done = 0
    for _ in range(kills):
        proc = subprocess.Popen(
            TRAIN + [recipe, "--run-id", "kill9", *SETTINGS],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(),
        )
        for line in proc.stdout:
            if parse_line(line):
                break
        time.sleep(rng.uniform(0.0, 6.0))  # anywhere in a step, a checkpoint write, or the export
        proc.kill()
        proc.wait()
        done += 1
    result = _run(recipe, "kill9")
    return {"fault": "kill -9 during training", "trials": done, **_audit(result, reference)}


def torn_trials(recipe: str, reference: dict, trials: int, rng: random.Random) -> dict:
    from draftflow.paths import RunLayout
    from draftflow.train import checkpointing

    fell_back = 0
    audits = []
    for k in range(trials):
        run_id = f"torn-{k}"
        stop_at = 2 * rng.randint(2, max(2, reference.steps // 2 - 1))
        first = _run(recipe, run_id, "--max-steps", str(stop_at), "--no-export")
        layout = RunLayout(first.run_dir)
        newest = Path(layout.checkpoint(checkpointing.marked_steps(layout)[0]))
        victim = rng.choice(
            [checkpointing.WEIGHTS, checkpointing.OPTIMIZER, checkpointing.RNG, checkpointing.STATE]
        )
        data = bytearray((newest / victim).read_bytes())
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (newest / victim).write_bytes(bytes(data))
        result = _run(recipe, run_id)
        fell_back += bool(result.torn_checkpoints) and not result.resumed_from.endswith(newest.name)
        audits.append(_audit(result, reference))
    return {
        "fault": "torn checkpoint (truncated or bit flip)",
        "trials": trials,
        "fell_back": fell_back,
        "lost_steps": sum(a["lost_steps"] for a in audits),
        "duplicated_steps": sum(a["duplicated_steps"] for a in audits),
        "corrupt_checkpoints_left": sum(a["corrupt_checkpoints"] for a in audits),
        "weights_equal_reference": sum(a["weights_equal_reference"] for a in audits),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--torn", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from draftflow.plan import Plan
    from draftflow.recipe.load import default_home

    fixtures = _fixtures()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="draftflow-train-faults-") as tmp:
        recipe = str(fixtures.write_recipe(Path(tmp)))
        fixtures.fill_store(Plan.load(recipe), default_home() / "models" / "SmolLM2-135M-Instruct")
        reference = _run(recipe, "reference")
        print(json.dumps({"reference_steps": reference.steps}), flush=True)
        if args.kills:
            print(json.dumps(kill_trials(recipe, reference, args.kills, rng)), flush=True)
        if args.torn:
            print(json.dumps(torn_trials(recipe, reference, args.torn, rng)), flush=True)


if __name__ == "__main__":
    main()
