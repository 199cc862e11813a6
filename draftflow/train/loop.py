"""The training loop: AdamW, warm-up + decay, clipping, data parallel, checkpoints, resume, SIGTERM.

A run folder lease lost on an object store (:mod:`draftflow.train.run_state`) stops every rank at
the end of the step, like SIGTERM, but with :class:`~draftflow.train.run_state.LeaseLost`.

Each pack of a step is a micro-batch whose loss is a mean over its own labelled tokens;
a step averages its packs (DDP averages over ranks), so N processes with batch b compute
exactly what one process with batch N·b computes. Anchors are drawn from a generator
seeded by (seed, step, pack index in the global step) for the same reason.

Data parallelism averages gradients with one flattened all-reduce per step rather than
through DistributedDataParallel: the drafters' losses call model methods other than
`forward` (context fusion, block building), which DDP's wrapper does not see.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from draftflow.models.common import with_every_position_labelled, with_feature_noise
from draftflow.paths import RunLayout
from draftflow.train import checkpointing, run_state
from draftflow.train.batches import Source, StepLoader, StepPlan
from draftflow.train.drafter import DrafterSetup
from draftflow.train.metrics import MetricsLog
from draftflow.train.optim import adamw
from draftflow.train.runtime import Runtime
from draftflow.train.schedule import lr_factor


@dataclass
class LoopResult:
    steps: int
    resumed_from: str | None
    interrupted: bool
    last_metrics: dict
    torn_checkpoints: list[str] = field(default_factory=list)  # newer checkpoints skipped on resume


class _Stop:
    """Set by SIGTERM; the loop checkpoints at the end of the current step and exits.

    A signal may reach one rank only (or the ranks at different steps): the flag is
    all-reduced at every step boundary, so all ranks stop after the same step, together.
    """

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def release(self, stopping: bool):
        """After the loop. Once a stop was agreed (on any rank), the checkpoint is written and the
        process is on its way to exit 143: a further SIGTERM must not kill it there. torchrun sends
        one to every rank still running as soon as the first rank exits, and a rank killed by it
        reports -15 instead of its clean 143. Ignored, not caught: Python puts the handlers it
        installed back to the default at interpreter shutdown, where that signal tends to land."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN if stopping else self._previous)


NOISE_SEED_OFFSET = 7919


def step_generator(seed: int, step: int, pack_index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) * 10_007 + pack_index)
    return g


@dataclass
class _Run:
    """What the steps of one run share: the model, its optimiser and schedule, the step plan, the
    state a checkpoint saves, and where metric lines go."""

    setup: DrafterSetup
    model: torch.nn.Module
    trainable: list[torch.nn.Parameter]
    plan: StepPlan
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: checkpointing.TrainState
    metrics: MetricsLog
    layout: RunLayout
    runtime: Runtime
    training: Any  # the recipe's TrainingSection
    monitor: Any  # draftflow.train.monitor.Monitor or None
    last_metrics: dict = field(default_factory=dict)  # the newest metric line

    def save_checkpoint(self) -> str:  # rank 0
        folder = checkpointing.save(self.layout, self.model, self.optimizer, self.scheduler, self.state)
        self.metrics.flush()
        if self.monitor is not None:
            self.monitor.flush()
        return folder


def train(
    setup: DrafterSetup,
    source: Source,
    layout: RunLayout,
    runtime: Runtime,
    training,
    max_steps: int | None = None,
    monitor=None,
    train_items: list | None = None,
) -> LoopResult:
    """`training` is the recipe's TrainingSection. `monitor` (a :class:`draftflow.train.monitor.Monitor`)
    validates and writes TensorBoard; `train_items` (default: every source item) excludes its split."""
    run, found = _start(setup, source, layout, runtime, training, monitor, train_items)
    loader = _loader(run, source)
    stop = _Stop()
    stopping = False
    window = _Window()
    try:
        for batch in loader:
            if max_steps is not None and run.state.step >= max_steps:
                break
            grad_norm = _step(run, batch, loader, window)
            end_of_epoch = run.state.epoch_step == run.plan.epoch_lengths[batch.epoch]
            _log_if_due(run, window, grad_norm, end_of_epoch)
            if end_of_epoch:
                run.state.epoch, run.state.epoch_step = run.state.epoch + 1, 0
            lease_lost = run_state.lease_problem() is not None  # rank 0's lease, on an object store
            stopping = bool(runtime.ranks_with(stop.requested or lease_lost))
            if stopping and runtime.ranks_with(lease_lost):
                raise _stop_for_lost_lease(run)
            _checkpoint_if_due(run, end_of_epoch, stopping)
            if stopping:
                return LoopResult(run.state.step, found.folder, True, run.last_metrics, found.torn)
    finally:
        stop.release(stopping)
        if monitor is not None:
            monitor.close()
    return LoopResult(run.state.step, found.folder, False, run.last_metrics, found.torn)


def _start(
    setup: DrafterSetup, source: Source, layout: RunLayout, runtime: Runtime, training, monitor, train_items
) -> tuple[_Run, checkpointing.Resumable]:
    """The model on its device, the step plan, optimiser and schedule, resumed from the newest
    complete checkpoint if there is one; the checkpoint found."""
    torch.manual_seed(training.seed)
    model = setup.to(runtime.device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    items = source.items() if train_items is None else train_items
    plan = StepPlan.build(
        items,
        epochs=training.epochs,
        seed=training.seed,
        pack_length=training.pack_length,
        batch_size=training.batch_size,
        world_size=runtime.world_size,
    )
    optimizer = adamw(trainable, lr=training.lr, weight_decay=training.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, plan.total_steps, training.warmup_ratio, training.schedule)
    )
    found, state = checkpointing.resume(layout, runtime, model, optimizer, scheduler)
    metrics = _continue_logs(found, state, layout, runtime, monitor)
    run = _Run(
        setup,
        model,
        trainable,
        plan,
        optimizer,
        scheduler,
        state,
        metrics,
        layout,
        runtime,
        training,
        monitor,
    )
    return run, found


def _continue_logs(found, state, layout: RunLayout, runtime: Runtime, monitor) -> MetricsLog:
    """The metrics log cut back to the resumed step (lines of steps after it are written again);
    the monitor starts from it too."""
    if found.folder:
        print(
            f"draftflow.train: rank {runtime.rank}/{runtime.world_size} resumes from {found.folder} "
            f"(step {state.step})",
            file=sys.stderr,
            flush=True,
        )
    metrics = MetricsLog(layout.metrics, enabled=runtime.is_main)
    metrics.truncate_after(state.step)
    if monitor is not None:
        monitor.start(state.step, [json.loads(ln) for ln in metrics.lines])
    return metrics


def _loader(run: _Run, source: Source) -> StepLoader:
    """This rank's share of each step, from the resumed position in the data on."""
    return StepLoader(
        run.plan,
        source,
        run.setup.layers,
        rank=run.runtime.rank,
        world_size=run.runtime.world_size,
        with_last=run.setup.with_last,
        start_epoch=run.state.epoch,
        start_step=run.state.epoch_step,
    )


def _step(run: _Run, batch, loader: StepLoader, window: _Window) -> torch.Tensor:
    """One optimiser step on this rank's packs, gradients averaged over ranks; the gradient norm."""
    t0 = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum, stats = _backward(run, batch)
    average_gradients(run.trainable, run.runtime)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable, run.training.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    state = run.state
    state.step += 1
    state.epoch, state.epoch_step = batch.epoch, batch.epoch_step + 1
    window.add(
        time.perf_counter() - t0, batch.tokens, loss_sum / run.training.batch_size, stats, loader.wait_s
    )
    loader.wait_s = 0.0
    return grad_norm


def _backward(run: _Run, batch) -> tuple[torch.Tensor, object]:
    """Forward and backward over each pack of the step (a micro-batch each, gradients summed);
    the packs' summed loss and loss metrics."""
    training, device, step = run.training, run.runtime.device, run.state.step
    stats = None
    loss_sum = torch.zeros((), device=device)
    for packed, gidx in zip(batch.packs, batch.global_index):
        packed = _to(packed, device)
        if training.loss_positions == "all":
            packed = with_every_position_labelled(packed)
        gen = step_generator(training.seed, step, gidx, device)
        if training.feature_noise:
            # its own stream: the anchors drawn from `gen` stay those of a run without noise
            noise = step_generator(training.seed + NOISE_SEED_OFFSET, step, gidx, device)
            packed = with_feature_noise(packed, training.feature_noise, noise)
        with run.runtime.autocast():
            out = run.setup.loss_fn(run.model, packed, gen)
        (out.loss / training.batch_size).backward()
        loss_sum += out.loss.detach()
        stats = out.metrics if stats is None else _add(stats, out.metrics)
    return loss_sum, stats


def _log_if_due(run: _Run, window: _Window, grad_norm: torch.Tensor, end_of_epoch: bool) -> None:
    """A metric line every `log_every` steps, at the end of each epoch and with each validation."""
    state, monitor = run.state, run.monitor
    validate = monitor is not None and monitor.validation_due(state.step, end_of_epoch)
    if not (state.step % run.training.log_every == 0 or end_of_epoch or validate):
        return
    last = window.record(
        state,
        run.runtime,
        lr=run.scheduler.get_last_lr()[0],
        grad_norm=float(grad_norm),
        total_steps=run.plan.total_steps,
    )
    if validate:
        last.update(monitor.validate(run.model, state.step))
    run.metrics.log(last)
    if monitor is not None:
        monitor.logged(last)
    run.last_metrics = last


def _stop_for_lost_lease(run: _Run) -> run_state.LeaseLost:
    """Every rank, once rank 0's lost lease was agreed: the last checkpoint if rank 0 may still
    write one, the monitor closed; the error to raise."""
    error = run_state.stop_for_lost_lease(run.runtime, run.save_checkpoint)
    if run.monitor is not None:  # what it had to keep went with that checkpoint, if any
        run.monitor.close(upload=False)
    return error


def _checkpoint_if_due(run: _Run, end_of_epoch: bool, stopping: bool) -> None:
    """Rank 0 writes a checkpoint at a stop, at the end of each epoch and every `checkpoint_every`
    steps; the others wait for it."""
    every = run.training.checkpoint_every
    if stopping or end_of_epoch or (every and run.state.step % every == 0):
        if run.runtime.is_main:
            run.save_checkpoint()
        run.runtime.barrier()


def average_gradients(params: list[torch.nn.Parameter], runtime: Runtime) -> None:
    if not runtime.distributed:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    runtime.all_reduce_sum(flat)
    flat /= runtime.world_size
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def _to(batch, device):
    from dataclasses import fields, replace

    return replace(
        batch,
        **{
            f.name: getattr(batch, f.name).to(device)
            for f in fields(batch)
            if getattr(batch, f.name) is not None
        },
    )


def _add(a, b):
    from dataclasses import fields, replace

    return replace(a, **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)})


class _Window:
    """Accumulates steps between two log lines; reduces across ranks when logging."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.steps, self.seconds, self.tokens, self.wait = 0, 0.0, 0, 0.0
        self.loss = 0.0
        self.stats = None

    def add(self, seconds, tokens, loss, stats, wait):
        self.steps += 1
        self.seconds += seconds + wait
        self.wait += wait
        self.tokens += tokens
        self.loss += float(loss)
        self.stats = stats if self.stats is None else _add(self.stats, stats)

    def record(self, state, runtime: Runtime, **extra) -> dict:
        from dataclasses import fields, replace

        s = self.stats
        reduced = replace(
            s, **{f.name: runtime.all_reduce_sum(getattr(s, f.name).clone().float()) for f in fields(s)}
        )
        totals = runtime.all_reduce_sum(torch.tensor([self.loss, float(self.tokens)]))
        record = {
            "step": state.step,
            "epoch": state.epoch,
            "loss": float(totals[0]) / (self.steps * runtime.world_size),
            "tokens_per_s": float(totals[1]) / max(self.seconds, 1e-9),
            "data_wait_frac": self.wait / max(self.seconds, 1e-9),
            "acc": [round(float(a), 4) for a in reduced.accuracy],
            "acceptance_length": reduced.acceptance_length,
            **extra,
        }
        self.reset()
        return record
