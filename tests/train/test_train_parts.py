"""Packing, schedules, checkpoints and metrics of the trainer (no model needed)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftflow.paths import CHECKPOINT_COMPLETE, RunLayout, join
from draftflow.train import checkpointing
from draftflow.train.metrics import MetricsLog, parse_line
from draftflow.train.packing import Item, epoch_order, global_steps, pack, rank_share
from draftflow.train.schedule import lr_factor
from draftflow.vllm.launch import free_port


def _items(n: int, seed: int = 0) -> list[Item]:
    rng = random.Random(seed)
    return [Item(f"s{i}", rng.randint(5, 60)) for i in range(n)]


def test_packing_respects_length_and_keeps_every_sample_once():
    items = _items(200)
    packs = pack(items, 128)
    assert all(sum(i.num_tokens for i in p) <= 128 for p in packs)
    assert [i for p in packs for i in p] == items


def test_packing_rejects_a_sample_longer_than_a_pack():
    with pytest.raises(ValueError, match="pack_length"):
        pack([Item("long", 300)], 128)


def test_epoch_order_is_seeded_and_differs_between_epochs():
    items = _items(50)
    assert epoch_order(items, 1, 0) == epoch_order(items, 1, 0)
    assert epoch_order(items, 1, 0) != epoch_order(items, 1, 1)
    assert sorted(epoch_order(items, 1, 3), key=lambda i: i.sample_id) == sorted(
        items, key=lambda i: i.sample_id
    )


def test_two_ranks_share_a_global_step_exactly_like_one_process_with_the_same_global_batch():
    packs = pack(_items(300), 100)
    one = global_steps(packs, batch_size=4, world_size=1)
    two = global_steps(packs, batch_size=2, world_size=2)
    assert one == two
    for step in two:
        union = rank_share(step, 0, 2) + rank_share(step, 1, 2)
        assert sorted(map(id, union)) == sorted(map(id, step))


def test_schedule_shapes():
    total = 100
    assert lr_factor(0, total, 0.1, "cosine") == pytest.approx(0.1)
    assert lr_factor(9, total, 0.1, "cosine") == pytest.approx(1.0)
    assert lr_factor(99, total, 0.1, "cosine") < 0.01
    assert lr_factor(55, total, 0.1, "linear") == pytest.approx(0.5)
    assert lr_factor(70, total, 0.1, "constant") == 1.0


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)  # frozen weights are not checkpointed
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def _train_steps(model, opt, sched, n):
    for _ in range(n):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_checkpoint_roundtrip_resumes_bit_identically(tmp_path, where, request, monkeypatch):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3")["url"] + "/ckpt-test"
    if where == "s3":
        import fsspec

        # How production passes S3 settings to the trainer: fsspec's config (env or file).
        monkeypatch.setitem(fsspec.config.conf, "s3", request.getfixturevalue("s3")["storage_options"])
    layout = RunLayout(join(root, "run"))
    model, opt, sched = _model_and_opt(0)
    _train_steps(model, opt, sched, 3)
    checkpointing.save(layout, model, opt, sched, checkpointing.TrainState(step=3, epoch=1, epoch_step=2))
    _train_steps(model, opt, sched, 2)
    reference = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = _model_and_opt(1)
    folder = checkpointing.newest_complete(layout)
    assert folder.endswith("step-00000003")
    state = checkpointing.restore(folder, model2, opt2, sched2)
    assert (state.step, state.epoch, state.epoch_step) == (3, 1, 2)
    model2[0].weight.data.copy_(model[0].weight.data)  # frozen part comes from the target, not the checkpoint
    _train_steps(model2, opt2, sched2, 2)
    for a, b in zip(reference, model2.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_without_marker_is_never_resumed(tmp_path):
    layout = RunLayout(str(tmp_path / "run"))
    model, opt, sched = _model_and_opt(0)
    checkpointing.save(layout, model, opt, sched, checkpointing.TrainState(step=5))
    checkpointing.save(layout, model, opt, sched, checkpointing.TrainState(step=9))
    (tmp_path / "run" / "checkpoints" / "step-00000009" / CHECKPOINT_COMPLETE).unlink()
    assert checkpointing.newest_complete(layout).endswith("step-00000005")


def test_metrics_lines_go_to_stdout_and_file_and_truncate_on_resume(tmp_path, capsys):
    log = MetricsLog(str(tmp_path / "m.jsonl"))
    for step in (5, 10, 15):
        log.log({"step": step, "loss": 1.0 / step})
    printed = [parse_line(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [p["step"] for p in printed] == [5, 10, 15]
    again = MetricsLog(str(tmp_path / "m.jsonl"))
    again.truncate_after(10)
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [5, 10]


def test_step_plan_counts_each_epoch_on_its_own():
    from draftflow.train.batches import StepPlan

    items = [(i.sample_id, i.num_tokens) for i in _items(300, seed=3)]
    plan = StepPlan.build(items, epochs=6, seed=0, pack_length=100, batch_size=1, world_size=1)
    lengths = [len(plan.steps(e)) for e in range(6)]
    assert plan.epoch_lengths == lengths and plan.total_steps == sum(lengths)
    assert len(set(lengths)) > 1, "packing after each epoch's shuffle gives epochs of different lengths"


def test_trainer_adamw_is_fused_on_cpu_and_updates_like_torchs_default():
    from draftflow.train.optim import adamw

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(5, 7, generator=g), torch.randn(7, generator=g)]
    grads = [[torch.randn_like(p) for p in init] for _ in range(3)]
    params = {}
    for name, make in (
        ("trainer", lambda ps: adamw(ps, lr=1e-2, weight_decay=0.1)),
        ("default", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ):
        ps = [torch.nn.Parameter(p.clone()) for p in init]
        opt = make(ps)
        for step in grads:
            for p, gr in zip(ps, step):
                p.grad = gr.clone()
            opt.step()
        params[name] = ps
        if name == "trainer":
            assert opt.param_groups[0]["fused"]
    for a, b in zip(params["trainer"], params["default"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


_REPORT_THREADS = """
import torch
from draftflow.train.runtime import init_runtime, shutdown
runtime = init_runtime("cpu")
print(torch.get_num_threads(), flush=True)
shutdown(runtime)
"""


@pytest.mark.slow
@pytest.mark.parametrize("one_core", [False, True], ids=["all-cores", "taskset-one-core"])
def test_cpu_ranks_of_different_nodes_each_get_their_nodes_cores(one_core):
    """Two nodes of one process each (WORLD_SIZE 2, LOCAL_WORLD_SIZE 1): a rank shares its
    cores with the ranks of its own node only, and only with the cores it may run on."""
    port = free_port()
    prefix = ["taskset", "-c", str(max(os.sched_getaffinity(0)))] if one_core else []
    procs = [
        subprocess.Popen(
            [*prefix, sys.executable, "-c", _REPORT_THREADS],
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    threads = [int(out.split()[-1]) for out in outputs]
    allowed = 1 if one_core else len(os.sched_getaffinity(0))
    assert threads == [allowed, allowed]


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("feature_noise", "0.05", "0.05"),
        ("loss_positions", "all", "'all'"),
        ("max_train_samples", "100", "100"),
    ],
)
def test_settings_added_later_are_compared_and_runs_recorded_before_them_still_resume(
    tmp_path, field, value, shown
):
    from draftflow.recipe import load_recipe
    from draftflow.train.run_state import RunSettingsChanged, check_settings, run_settings

    demo = str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-dflash-cpu-demo.yaml")
    plain = run_settings(load_recipe(demo), 1, [])
    assert field not in plain["training"]  # off: recorded as runs recorded it before
    changed = run_settings(load_recipe(demo, [f"training.{field}={value}"]), 1, [])
    assert str(changed["training"][field]) == value

    layout = RunLayout(str(tmp_path / "run"))
    check_settings(layout, plain)  # a run recorded without the field...
    Path(layout.checkpoint(1)).mkdir(parents=True)
    (Path(layout.checkpoint(1)) / CHECKPOINT_COMPLETE).touch()  # a checkpoint to resume from
    check_settings(layout, run_settings(load_recipe(demo), 1, []))  # ...resumes under the same recipe
    with pytest.raises(RunSettingsChanged, match=rf"training.{field}: '\(unset\)' -> {shown}"):
        check_settings(layout, changed)


@pytest.mark.slow
def test_a_cpu_trainer_reuses_freed_memory_instead_of_page_faulting_it_again():
    """A training step frees and re-allocates the same large tensors every step. glibc serves
    allocations above its mmap threshold (at most 32 MiB by default) with fresh pages that
    fault on first touch, every step: 8k tokens × 1,024 anchors took ~160,000 page faults a
    step. Once the CPU runtime has started, a step that allocates three 64 MiB tensors
    touches no new page after a few steps."""
    probe = """
import resource, statistics, sys, torch
if sys.argv[1] == "runtime":
    from draftflow.train.runtime import init_runtime
    init_runtime("cpu")
def step():
    x = torch.randn(16384, 1024)
    return float(torch.softmax(x * 2.0, -1)[0, 0])
for _ in range(8):
    step()
per_step = []
for _ in range(7):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    per_step.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print(statistics.median(per_step))
"""

    def faults(mode: str) -> float:
        cmd = [sys.executable, "-c", probe, mode]
        return float(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout)

    # the median step: the kept heap may still grow once in a while (a freed hole that does not
    # fit the next request), which is not what this is about
    assert faults("default") > 3 * 16_000  # every 64 MiB tensor faults in again
    assert faults("runtime") < 1_000
