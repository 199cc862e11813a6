"""What the trainer reports besides its loss: validation τ, the best step, TensorBoard, a chart.

:class:`Monitor` is handed to :func:`draftflow.train.loop.train`. It holds the validation
split back from training, runs :mod:`draftflow.train.validation` at every epoch end and
every ``training.eval_every`` steps, keeps the trainable weights of the best validation τ
in ``RUN/best/`` (exported instead of the last step's), writes every logged record to
TensorBoard event files under ``RUN/tensorboard`` and redraws ``RUN/training_curves.png``.
Only rank 0 writes; every rank runs the validation (the counts are all-reduced).

The target's full-vocabulary head (the greedy reference) is frozen, so each validation sample's
greedy tokens are computed once and cached; the head is held only until then (the first
validation), not on the device for the whole run. The best weights and ``best.json`` are each
written whole; a torn or dangling ``best.json`` (an older trainer's crash) falls back to the
last best the metrics name whose weights exist, with a warning, instead of failing the resume.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from draftflow.paths import RunLayout
from draftflow.remote import open_url, url_to_fs
from draftflow.train import checkpointing, validation
from draftflow.train.runtime import Runtime

# Rows per full-vocabulary head product: fp32 logits of a 64k-token sample at once would take
# 64k x vocabulary x 4 bytes (tens of GB at a 150k vocabulary); 1,024 rows take under 1 GB.
GREEDY_ROWS = 1024
BEST_WEIGHTS_NAME = re.compile(r"step-\d{8}\.safetensors")  # what RunLayout.best_weights names


@dataclass(frozen=True)
class Best:
    step: int
    tau: float
    weights: str  # URL of the trainable weights

    def as_dict(self) -> dict:
        return {"step": self.step, "val_tau": self.tau, "weights": self.weights}


def _is_local(url: str) -> bool:
    fs, _ = url_to_fs(url)
    return "file" in fs.protocol or fs.protocol in ("file", "local")


class Monitor:
    def __init__(
        self,
        *,
        layout: RunLayout,
        runtime: Runtime,
        source,
        draft_length: int,
        target_model: str,
        last_layer: int | None,
        context_layers: tuple[int, ...],
        validation_ids: list[str],
        eval_every: int = 0,
        board: bool = True,
    ):
        self.layout, self.runtime, self.source = layout, runtime, source
        self.draft_length = int(draft_length)
        self.target_model, self.last_layer, self.context_layers = target_model, last_layer, context_layers
        self.validation_ids = list(validation_ids)
        self.eval_every = int(eval_every)
        self.best: Best | None = None
        self.validations = 0
        self._greedy: dict[str, torch.Tensor] = {}
        self._head = None
        self._records: list[dict] = []
        self._board = _Board(layout) if board and runtime.is_main else None
        self._bar = None
        if runtime.is_main and sys.stderr.isatty():  # a person at a terminal: a rich bar on stderr
            from draftflow.progress import Progress, RichBar

            self._bar = Progress("training", None, unit="steps", sinks=[RichBar()], interval_s=1.0)

    @classmethod
    def for_plan(cls, plan, setup, source, layout: RunLayout, runtime: Runtime) -> tuple[Monitor, list]:
        """(monitor, train items): the validation split held back, the rest capped at max_train_samples."""
        t = plan.recipe.training
        train_items, held = validation.split_items(
            source.items(), t.validation_fraction, t.validation_max_samples
        )
        train_items = validation.subset_items(train_items, t.max_train_samples)
        spec = plan.recipe.drafter
        monitor = cls(
            layout=layout,
            runtime=runtime,
            source=source,
            draft_length=spec.speculative_tokens,
            target_model=plan.target_model,
            last_layer=setup.layers.last,
            context_layers=setup.layers.context,
            validation_ids=held,
            eval_every=t.eval_every,
        )
        return monitor, train_items

    # -- the loop's hooks ---------------------------------------------------------------

    def start(self, step: int, earlier_records: list[dict]) -> None:
        """After a resume at ``step``: earlier records and the best step up to it are kept."""
        self._records = [r for r in earlier_records if r.get("step", 0) <= step]
        self.validations = sum(1 for r in self._records if "val_tau" in r)
        self.best = self._recover_best(step)
        if self._board is not None:
            self._board.open(purge_step=step + 1 if step else None)

    def validation_due(self, step: int, end_of_epoch: bool) -> bool:
        if not self.validation_ids:
            return False
        return end_of_epoch or (self.eval_every > 0 and step % self.eval_every == 0)

    def validate(self, model: torch.nn.Module, step: int) -> dict:
        """Every rank calls this at the same step; returns the record fields (same on all ranks)."""
        counts = validation.AcceptanceCounts(self.draft_length)
        mine = self.validation_ids[self.runtime.rank :: self.runtime.world_size]
        device = self.runtime.device
        with torch.no_grad(), self.runtime.autocast():
            for sample in self.source.load(mine):
                hidden = sample.hidden_states[:, list(self.context_layers)].to(device)
                ids, mask = sample.token_ids.long().to(device), sample.loss_mask.to(device)
                greedy = self._greedy_next(sample).to(device)
                counts.merge(validation.sample_counts(model, self.draft_length, hidden, ids, mask, greedy))
        self._head = None  # every sample of `mine` now has its greedy tokens cached: the head is not needed
        total = self.runtime.all_reduce_sum(counts.as_tensor().to(device)).cpu()
        counts = validation.AcceptanceCounts.from_tensor(self.draft_length, total)
        self.validations += 1
        record = {
            "val_tau": counts.tau,
            "val_acc": [round(p, 4) for p in counts.per_position],
            "val_drafts": counts.drafts,
            "val_samples": len(self.validation_ids),
            "val_reference": "target" if self.last_layer is not None else "data",
        }
        if self.best is None or counts.tau > self.best.tau:
            self.best = Best(step, counts.tau, self.layout.best_weights(step))
            if self.runtime.is_main:
                _write_best(self.layout, model, self.best)
        record["best_step"], record["best_val_tau"] = self.best.step, self.best.tau
        return record

    def logged(self, record: dict) -> None:
        """After each metrics line (rank 0 writes TensorBoard; the chart after validations)."""
        if not self.runtime.is_main:
            return
        self._records.append(record)
        if self._bar is not None:
            self._bar.update(done=record["step"], total=record.get("total_steps"))
        if self._board is not None:
            self._board.add(record)
        if "val_tau" in record:
            self.write_curves()

    def flush(self) -> None:
        if self._board is not None:
            self._board.flush()

    def close(self, upload: bool = True) -> None:
        """``upload=False``: a remote run folder gets nothing more (its lease was lost)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._board is not None:
            self._board.close(upload)

    # -- helpers ------------------------------------------------------------------------

    def _recover_best(self, step: int) -> Best | None:
        """best.json if it is whole and names existing weights; otherwise the last best the metrics
        name whose weights exist, and best.json is rewritten to name it (the export reads it)."""
        recorded = _read_best(self.layout)
        if recorded is not None:
            return recorded if recorded.step <= step else None  # later ones: steps about to run again
        fs, path = url_to_fs(self.layout.best_record)
        if not fs.exists(path):
            return None
        best = _best_from_records(self.layout, self._records)
        if best is not None and self.runtime.is_main:
            checkpointing.put_whole(self.layout.best_record, json.dumps(best.as_dict()).encode())
            _warn(
                f"{self.layout.best_record} now names step {best.step} (val τ {best.tau:.4f}) from the metrics"
            )
        return best

    def _greedy_next(self, sample) -> torch.Tensor:
        """g[i] (see validation's module doc), cached per sample: the head is frozen. The head is loaded
        while some sample lacks its tokens and dropped at the end of that validation (see validate)."""
        cached = self._greedy.get(sample.sample_id)
        if cached is not None:
            return cached
        if self.last_layer is None:
            g = torch.cat([sample.token_ids[1:].long(), torch.full((1,), -1, dtype=torch.long)])
        else:
            if self._head is None:
                from draftflow.models.target_weights import TargetHead

                self._head = TargetHead.from_pretrained(self.target_model, None).to(self.runtime.device)
            last = sample.hidden_states[:, self.last_layer]
            g = torch.cat(
                [
                    self._head(last[s : s + GREEDY_ROWS].to(self.runtime.device)).argmax(-1).cpu()
                    for s in range(0, last.shape[0], GREEDY_ROWS)
                ]
            )
        self._greedy[sample.sample_id] = g
        return g

    def write_curves(self) -> str:
        from draftflow.train.curves import plot_training_curves

        with tempfile.TemporaryDirectory() as tmp:
            local = f"{tmp}/curves.png"
            plot_training_curves(self._records, local, best_step=self.best.step if self.best else None)
            fs, path = url_to_fs(self.layout.training_curves)
            fs.put_file(local, path)
        return self.layout.training_curves


def _write_best(layout: RunLayout, model: torch.nn.Module, best: Best) -> None:
    """Weights first, then best.json naming them, each written whole (temp name, fsync, rename; one PUT
    on object stores): a crash at any point leaves the previous best.json and the weights it names."""
    trainable = {
        n: p.detach().float().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad
    }
    fs, folder = url_to_fs(layout.best_dir)
    fs.makedirs(folder, exist_ok=True)
    checkpointing.put_whole(best.weights, save_safetensors(trainable))
    checkpointing.put_whole(layout.best_record, json.dumps(best.as_dict()).encode())
    keep = url_to_fs(best.weights)[1].rstrip("/").rsplit("/", 1)[-1]
    for entry in fs.ls(folder, detail=False):  # earlier bests, and weights a crash left unnamed
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if BEST_WEIGHTS_NAME.fullmatch(name) and name != keep:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(entry)


def _warn(message: str) -> None:
    print(f"draftflow.train: warning: {message}", file=sys.stderr, flush=True)


def _read_best(layout: RunLayout) -> Best | None:
    """best.json and the weights it names; None, with a warning, when it is torn or they are missing."""
    fs, path = url_to_fs(layout.best_record)
    if not fs.exists(path):
        return None
    try:
        data = json.loads(fs.cat_file(path))
        best = Best(int(data["step"]), float(data["val_tau"]), str(data["weights"]))
    except (ValueError, KeyError, TypeError) as err:
        _warn(f"{layout.best_record} is unreadable ({err}); it is not used")
        return None
    if not _weights_exist(best.weights):
        _warn(f"{layout.best_record} names {best.weights}, which is missing; it is not used")
        return None
    return best


def _weights_exist(url: str) -> bool:
    fs, path = url_to_fs(url)
    return fs.exists(path)


def _best_from_records(layout: RunLayout, records: list[dict]) -> Best | None:
    """The newest best step the metrics name whose weights are still in RUN/best/."""
    for record in reversed(records):
        if "best_step" in record:
            step = int(record["best_step"])
            best = Best(step, float(record["best_val_tau"]), layout.best_weights(step))
            return best if _weights_exist(best.weights) else None
    return None


def load_best(layout: RunLayout, model: torch.nn.Module) -> Best | None:
    """Copy the best validation step's trainable weights into ``model``; None if there is none usable
    (the caller then keeps the last step's weights; the reason is on stderr)."""
    best = _read_best(layout)
    if best is None:
        return None
    try:
        with open_url(best.weights, "rb") as f:
            weights = load_safetensors(f.read())
    except (OSError, SafetensorError) as err:
        _warn(f"the best weights {best.weights} cannot be read ({err}); they are not used")
        return None
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    return best


class _Board:
    """TensorBoard scalars of every metrics record (rank 0). Remote run folders: event files
    are written locally and uploaded at each flush."""

    def __init__(self, layout: RunLayout):
        self.url = layout.tensorboard_dir
        self.local = _is_local(self.url)
        self.writer = None
        self._tmp = None

    def open(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.local:
            folder = url_to_fs(self.url)[1]
        else:
            self._tmp = tempfile.TemporaryDirectory()
            folder = self._tmp.name
        self.writer = SummaryWriter(log_dir=folder, purge_step=purge_step)

    def add(self, record: dict) -> None:
        if self.writer is None:
            return
        step = int(record["step"])
        for key in ("loss", "lr", "tokens_per_s", "acceptance_length", "grad_norm"):
            if key in record:
                self.writer.add_scalar(f"train/{key}", float(record[key]), step)
        for i, a in enumerate(record.get("acc", [])):
            self.writer.add_scalar(f"train/acc_{i + 1}", float(a), step)
        if "val_tau" in record:
            self.writer.add_scalar("val/tau", float(record["val_tau"]), step)
            for i, a in enumerate(record["val_acc"]):
                self.writer.add_scalar(f"val/acc_{i + 1}", float(a), step)

    def flush(self) -> None:
        if self.writer is None:
            return
        self.writer.flush()
        if not self.local:
            fs, path = url_to_fs(self.url)
            fs.put(self._tmp.name + "/", path, recursive=True)

    def close(self, upload: bool = True) -> None:
        if self.writer is not None:
            if upload:
                self.flush()
            self.writer.close()
            self.writer = None
        if self._tmp is not None:
            self._tmp.cleanup()
