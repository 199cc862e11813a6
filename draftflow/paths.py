"""Every storage path draftflow reads or writes is built here, and nowhere else.

URLs are fsspec URLs (``/abs/path``, ``file:///…``, ``s3://bucket/prefix``, ``/dev/shm/…``).
Ids that come from data (sample ids, shard ids, run ids) pass :func:`safe_component`
before they become part of a path, so a crafted id can never escape its folder.

Layout of a store::

    STORE/NAME-FINGERPRINT/                  DataLayout: one per recipe fingerprint (a recipe with a
                                             traffic source: one per window, a segment)
    STORE/NAME.segments.jsonl                the segments listed complete, oldest first (segment_index)
        fingerprint.json                     what the fingerprint was computed from
        prepared/samples.parquet             ids, token ids, loss masks, split
        prepared/token_counts.parquet        counts over loss-masked tokens
        prepared/report.json                 counts of kept / dropped / truncated samples
        shards/SHARD-WRITER.safetensors      immutable shard objects (SHARD = shard_id(k))
        manifest/fragments/SHARD-WRITER.arrow  one immutable fragment per committed shard
        manifest/compacted/STAMP.arrow       fragments merged by `store compact`
        …/.NAME.TOKEN.tmp                    a local write in progress (renamed when done)
        vocab/draft-vocab-SIZE.safetensors   d2t / t2d for one draft vocab size
        generation/source-N.jsonl            append-only attempts of a self-generated source
                                             (resume after a kill; local stores only, see
                                             generation_partial)

    RUN_DIR/NAME-FINGERPRINT/RUN_ID/         RunLayout: one training run
        metrics.jsonl, train.log
        run.json, .lock, skipped-samples.json  the run's settings, its trainer's lock, samples skipped
        tensorboard/events.out.tfevents.*    loss and validation τ (`tensorboard --logdir RUN`)
        training_curves.png                  loss and validation τ against step
        checkpoints/step-NNNNNNNN/{model,optim,state}… + COMPLETE
        best/step-NNNNNNNN.safetensors + best.json  trainable weights of the best validation τ
        export/                              the speculators folder vLLM serves
        eval/report.json, report.md, acceptance.png

    LOCAL_HOME/remote-copies/HASH-RUN_ID-export  a remote export downloaded for the contract check,
                                             the offline simulator, `vllm serve`, the model card
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHARDS = "shards"
SHARD_SUFFIX = ".safetensors"
ARROW_SUFFIX = ".arrow"
TEMP_SUFFIX = ".tmp"
DROPPED_SUFFIX = ".dropped.json"

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def safe_component(value: str) -> str:
    """Return ``value`` if it is a single safe path component, else raise ValueError."""
    if not isinstance(value, str) or not _SAFE.match(value) or ".." in value:
        raise ValueError(f"unsafe path component {value!r}")
    return value


def shard_id(index: int) -> str:
    """Shard id of the k-th block of the prepared sample list; zero-padded so names sort by k."""
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    return f"{int(index):06d}"


def temp_sibling(url: str, token: str) -> str:
    """Where a local write of ``url`` goes before its rename: same folder (so the rename is
    atomic), hidden name with a suffix no listing of final objects ever matches."""
    folder, _, name = url.rstrip("/").rpartition("/")
    return join(folder, f".{name}.{safe_component(token)}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def join(base: str, *parts: str) -> str:
    """Join URL parts with '/', keeping the scheme (fsspec accepts '/' on every backend)."""
    out = base.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def segment_index(store: str, name: str) -> str:
    """The list of a recipe's complete data segments (draftflow.data.segments)."""
    return join(store, f"{safe_component(name)}.segments.jsonl")


@dataclass(frozen=True)
class DataLayout:
    """Paths inside one fingerprinted data folder."""

    root: str

    @classmethod
    def for_recipe(cls, store: str, name: str, fingerprint: str) -> DataLayout:
        return cls(join(store, f"{safe_component(name)}-{safe_component(fingerprint)}"))

    @property
    def fingerprint_file(self) -> str:
        return join(self.root, "fingerprint.json")

    @property
    def prepared_dir(self) -> str:
        return join(self.root, "prepared")

    @property
    def samples(self) -> str:
        return join(self.prepared_dir, "samples.parquet")

    @property
    def token_counts(self) -> str:
        return join(self.prepared_dir, "token_counts.parquet")

    @property
    def prepare_report(self) -> str:
        return join(self.prepared_dir, "report.json")

    @property
    def shards_dir(self) -> str:
        return join(self.root, _SHARDS)

    def shard_key(self, shard_id: str, writer: str) -> str:
        """A shard's path relative to this folder, as the manifest stores it (so a copy stays valid)."""
        return f"{_SHARDS}/{safe_component(shard_id)}-{safe_component(writer)}{SHARD_SUFFIX}"

    def shard(self, shard_id: str, writer: str) -> str:
        return join(self.root, self.shard_key(shard_id, writer))

    def resolve_shard_key(self, key: str) -> str:
        """URL of a manifest's relative shard path; rejects anything outside ``shards/``."""
        folder, _, name = key.partition("/")
        if folder != _SHARDS or not name.endswith(SHARD_SUFFIX):
            raise ValueError(f"not a shard key: {key!r}")
        return join(self.shards_dir, safe_component(name))

    @property
    def fragments_dir(self) -> str:
        return join(self.root, "manifest", "fragments")

    def fragment(self, shard_id: str, writer: str) -> str:
        return join(self.fragments_dir, f"{safe_component(shard_id)}-{safe_component(writer)}{ARROW_SUFFIX}")

    @property
    def compacted_dir(self) -> str:
        return join(self.root, "manifest", "compacted")

    def compacted(self, stamp: str) -> str:
        return join(self.compacted_dir, f"{safe_component(stamp)}{ARROW_SUFFIX}")

    def dropped_record(self, stamp: str) -> str:
        """Which shard objects a compaction stopped referencing; its mtime starts their gc grace."""
        return join(self.compacted_dir, f"{safe_component(stamp)}{DROPPED_SUFFIX}")

    def draft_vocab(self, size: int) -> str:
        return join(self.root, "vocab", f"draft-vocab-{int(size)}.safetensors")

    def generation_partial(self, source_index: int, local_home: str) -> str:
        """Local file of one self-generated source's finished attempts, appended as they finish.

        Appending needs a local filesystem: for a local store it sits in the data folder; for a
        remote one (s3://) under ``local_home``, in a folder named like the data folder.
        """
        name = f"source-{int(source_index)}.jsonl"
        if "://" not in self.root or self.root.startswith("file://"):
            return join(self.root.removeprefix("file://"), "generation", name)
        return join(local_home, "generation", safe_component(self.root.rstrip("/").rpartition("/")[2]), name)


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one training run folder."""

    root: str

    @classmethod
    def for_run(cls, run_dir: str, name: str, fingerprint: str, run_id: str) -> RunLayout:
        return cls(
            join(run_dir, f"{safe_component(name)}-{safe_component(fingerprint)}", safe_component(run_id))
        )

    @property
    def metrics(self) -> str:
        return join(self.root, "metrics.jsonl")

    @property
    def log(self) -> str:
        return join(self.root, "train.log")

    @property
    def settings(self) -> str:
        """The settings the run was started with; a resume under other settings is refused."""
        return join(self.root, "run.json")

    @property
    def lock(self) -> str:
        """Held by the run's trainer while it runs (flock locally, a lease object on object stores)."""
        return join(self.root, ".lock")

    @property
    def skipped_samples(self) -> str:
        """Train samples the run trained without (training.max_missing_fraction), with reasons."""
        return join(self.root, "skipped-samples.json")

    def set_aside(self, stamp: str) -> str:
        """Where --force-new moves an earlier run's files: beside the run, never deleted."""
        return f"{self.root}.replaced-{safe_component(stamp)}"

    @property
    def checkpoints_dir(self) -> str:
        return join(self.root, "checkpoints")

    def checkpoint(self, step: int) -> str:
        return join(self.checkpoints_dir, f"step-{int(step):08d}")

    @property
    def export_dir(self) -> str:
        return join(self.root, "export")

    @property
    def tensorboard_dir(self) -> str:
        return join(self.root, "tensorboard")

    @property
    def training_curves(self) -> str:
        return join(self.root, "training_curves.png")

    @property
    def best_dir(self) -> str:
        return join(self.root, "best")

    @property
    def best_record(self) -> str:
        return join(self.best_dir, "best.json")

    def best_weights(self, step: int) -> str:
        return join(self.best_dir, f"step-{int(step):08d}.safetensors")

    @property
    def eval_dir(self) -> str:
        return join(self.root, "eval")

    @property
    def eval_report(self) -> str:
        return join(self.eval_dir, "report.json")

    @property
    def eval_summary(self) -> str:
        return join(self.eval_dir, "report.md")

    @property
    def eval_chart(self) -> str:
        return join(self.eval_dir, "acceptance.png")


def remote_copy(url: str, local_home: str) -> str:
    """Local copy of a remote folder (an export on s3:// that the contract check, the offline
    simulator, `vllm serve` or the model card need as files): named by the folder's last two
    components and a hash of the whole URL, so two runs' `export/` folders never share a copy."""
    import hashlib

    parts = [p for p in url.split("://", 1)[-1].rstrip("/").split("/") if p][-2:]
    name = "-".join(re.sub(r"[^A-Za-z0-9._-]", "_", p).lstrip(".") or "_" for p in parts)
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]
    return join(local_home, "remote-copies", safe_component(f"{digest}-{name[:100]}"))


def remote_copy_stamp(url: str, local_home: str) -> str:
    """The listing (names, sizes, ETags) a :func:`remote_copy` was made from, beside it (not in it:
    files inside an export count in its digest)."""
    return remote_copy(url, local_home) + ".listing.json"


def prompt_set_file(name: str) -> str:
    """The evaluation prompt set ``name`` shipped inside the package (JSON lines: id, category, prompt)."""
    from pathlib import Path

    return str(Path(__file__).parent / "evaluation" / "prompt_sets" / f"{safe_component(name)}.jsonl")


# File names inside a checkpoint or export folder (shared by the trainer, exporter and evaluator).
CHECKPOINT_COMPLETE = "COMPLETE"
EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_RECIPE = "recipe.yaml"
EXPORT_COMMAND = "train_command.txt"
EXPORT_SELECTION = "selection.json"  # which training step was exported, and why
MODEL_CARD = "README.md"
# A publish destination (draftflow.releases): DEST/NAME-VERSION/ folders, each complete once it holds
# PUBLISHED_MARKER, and per recipe DEST/NAME + RELEASE_POINTER_SUFFIX and + RELEASE_HISTORY_SUFFIX.
PUBLISHED_MARKER = "PUBLISHED"
RELEASE_POINTER_SUFFIX = ".current.json"
RELEASE_HISTORY_SUFFIX = ".history.jsonl"
PROVENANCE = "provenance.json"
