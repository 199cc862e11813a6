"""The recipe schema: every field a recipe may set, with its default and its meaning.

This module is the only place defaults live (with the sections it imports: the `prefect`
section in :mod:`draftflow.recipe.prefect_section`, the `vllm` section in
:mod:`draftflow.recipe.vllm_section`; and each drafter kind's section, in the kind's own
``section`` module found by :mod:`draftflow.models.registry`). YAML files set what differs from
here; code reads the validated object and never calls ``.get(key, default)`` on raw dicts.

Checks that need nothing but the recipe run when the object is built (pydantic validators).
Checks that need the target model's config (layer ids in range, draft vocab within the target
vocab) live in :mod:`draftflow.recipe.checks`: that config may not be readable (offline hub id).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    FiniteFloat,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from draftflow.models import registry
from draftflow.recipe.prefect_section import PrefectSection
from draftflow.recipe.refresh_section import RefreshSection
from draftflow.recipe.section import (  # noqa: F401  (the bounds are re-exported)
    MAX_COUNT,
    MAX_PARALLEL,
    MAX_SECONDS,
    MAX_TOKENS,
    MAX_VOCAB,
    DrafterSection,
    Section,
)
from draftflow.recipe.self_generated_section import SelfGeneratedSection, Topic  # noqa: F401  (re-exported)
from draftflow.recipe.traffic_section import TrafficSection
from draftflow.recipe.vllm_section import VLLMLaunchSection, VLLMSection  # noqa: F401  (re-exported)

ComputeDtype = Literal["bfloat16", "float16", "float32"]  # what a vLLM server computes in
Dtype = Literal[ComputeDtype, "float8_e4m3", "float8_e5m2"]  # what a store may hold


class TargetSection(Section):
    """The verifier model the drafter is trained for."""

    model: str = Field(
        description="Local folder or Hugging Face hub id. `${DRAFTFLOW_HOME}` and other "
        "environment variables are expanded when the recipe is used, not when it is hashed."
    )
    revision: str | None = Field(None, description="Hub revision (commit, tag or branch).")
    chat_template: str | None = Field(
        None, description="Path to a Jinja chat template that replaces the tokenizer's own."
    )


class DataSource(Section):
    """One source of conversations."""

    kind: Literal[
        "sharegpt", "messages", "hf_disk", "chitchat", "chatterbot", "self_generated", "traffic"
    ] = Field(
        description="sharegpt: JSON/JSONL with `conversations` (from/value); messages: "
        "JSON/JSONL with OpenAI `messages` (role/content); hf_disk: a `datasets` folder saved "
        "with save_to_disk; chitchat / chatterbot: the corpora shipped by those pip packages; "
        "self_generated: the target writes the user turns through vLLM (see `self_generated`); "
        "traffic: served request/response logs, one time window per run (see `traffic`)."
    )
    path: str | None = Field(None, description="File or folder; required for sharegpt, messages, hf_disk.")
    max_samples: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Take at most this many conversations."
    )
    self_generated: SelfGeneratedSection | None = Field(
        None, description="Settings of a `self_generated` source (default settings when omitted)."
    )
    traffic: TrafficSection | None = Field(
        None, description="Settings of a `traffic` source (required there)."
    )

    @model_validator(mode="after")
    def _path_required(self) -> DataSource:
        if self.kind in ("sharegpt", "messages", "hf_disk") and not self.path:
            raise ValueError(f"a `{self.kind}` source needs `path`")
        if self.self_generated is not None and self.kind != "self_generated":
            raise ValueError(f"`self_generated` settings need `kind: self_generated`, not `{self.kind}`")
        if self.kind == "self_generated" and self.path:
            raise ValueError("a `self_generated` source has no `path`")
        if self.kind == "traffic" and self.traffic is None:
            raise ValueError("a `traffic` source needs `traffic` settings (at least `traffic.paths`)")
        if self.traffic is not None and self.kind != "traffic":
            raise ValueError(f"`traffic` settings need `kind: traffic`, not `{self.kind}`")
        if self.kind == "traffic" and self.path:
            raise ValueError("a `traffic` source reads `traffic.paths`, not `path`")
        return self

    @property
    def generation(self) -> SelfGeneratedSection:
        """The settings of a self-generated source (the schema's defaults when the recipe omits them)."""
        return self.self_generated or SelfGeneratedSection()


class DataSection(Section):
    """Which conversations become training and evaluation samples."""

    sources: list[DataSource] = Field(min_length=1)
    num_samples: int | None = Field(None, ge=1, le=MAX_COUNT, description="Total cap after mixing sources.")
    eval_samples: int = Field(
        16, ge=0, le=MAX_COUNT, description="Held-out samples for acceptance evaluation."
    )
    seed: int = Field(0, description="Shuffle and split seed.")
    max_length: int = Field(
        1023, ge=8, le=MAX_TOKENS, description="Tokens per sample; longer samples are truncated and counted."
    )
    regenerate_responses: bool = Field(
        False, description="Regenerate assistant turns with the target through vLLM's chat endpoint."
    )
    regenerate_max_tokens: int = Field(256, ge=1, le=MAX_TOKENS)
    regenerate_concurrency: int = Field(8, ge=1, le=MAX_PARALLEL)
    generation_dtype: ComputeDtype | None = Field(
        None,
        description="dtype of the plain server launched to write prompts and replies (default: the "
        "extraction server's; a running server is used as it is). Labels still come from the "
        "extraction server; bfloat16 writes faster on CPUs with AVX-512 BF16 or AMX.",
    )

    @field_validator("sources")
    @classmethod
    def _one_traffic_source(cls, sources: list[DataSource]) -> list[DataSource]:
        # The window is the run's (one `since`, one segment per run): two traffic sources would
        # need two windows for one folder.
        if sum(s.kind == "traffic" for s in sources) > 1:
            raise ValueError("at most one `traffic` source (list several globs in its `traffic.paths`)")
        return sources

    @property
    def traffic(self) -> TrafficSection | None:
        """The settings of the recipe's traffic source, if it has one."""
        return next((s.traffic for s in self.sources if s.kind == "traffic"), None)


class ExtractionSection(Section):
    """How hidden states are extracted and where they are stored."""

    layer_ids: list[int] | None = Field(
        None,
        description="Target layer ids to extract (id k = residual stream entering layer k; "
        "id L = last layer output before the final norm). Default: [2, L//2, L-3, L].",
    )
    dtype: Dtype = Field(
        "bfloat16",
        description="Stored dtype of hidden states. float8_e4m3 / float8_e5m2: FP8 values with one "
        "bf16 scale per token and layer (about half the bytes of bfloat16), decoded when loaded.",
    )
    store: str = Field("./draftflow-store", description="fsspec URL of the shard store.")
    samples_per_shard: int = Field(64, ge=1, le=2**20)
    mode: Literal["offline", "online", "hybrid"] = Field(
        "offline",
        description="offline: every shard must exist before training; online: generated on "
        "demand and deleted after use; hybrid: existing shards reused, missing ones generated and kept.",
    )
    concurrency: int = Field(4, ge=1, le=MAX_PARALLEL, description="Requests in flight per vLLM endpoint.")
    request_retries: int = Field(3, ge=0, le=100)
    request_timeout_s: FiniteFloat = Field(120.0, gt=0, le=MAX_SECONDS)

    @field_validator("dtype")
    @classmethod
    def _float8_available(cls, dtype: str) -> str:
        if dtype.startswith("float8_"):
            # Imported here: torch is only needed (and only checked) when FP8 is asked for.
            from draftflow.store.fp8 import float8_unavailable

            reason = float8_unavailable(dtype)
            if reason:
                raise ValueError(f"{dtype} needs float8 support in torch, but {reason}")
        return dtype


def _drafter_section(value: Any) -> Any:
    """``drafter`` validated as the section of the kind it names (each kind's ``section`` module,
    found by :mod:`draftflow.models.registry`); errors keep their place, e.g. ``drafter.block_size``."""
    if isinstance(value, DrafterSection):  # built in Python: validated when it was made
        return value
    if not isinstance(value, dict):
        raise _error("model_attributes_type", (), value)
    if "kind" not in value:
        raise _error("missing", ("kind",), value)
    found = registry.sections()
    kind = value["kind"]
    if not isinstance(kind, str) or kind not in found:
        known = ", ".join(map(repr, found))
        unknown = PydanticCustomError(
            "drafter_kind",
            "unknown drafter kind {kind}; known: {known}",
            {"kind": repr(kind), "known": known},
        )
        raise _error(unknown, ("kind",), kind)
    return found[kind].model_validate(value)


def _error(error: str | PydanticCustomError, loc: tuple, value: Any) -> ValidationError:
    # Raised in a validator, a ValidationError reaches the recipe's with each location under `drafter`.
    return ValidationError.from_exception_data(
        "drafter", [InitErrorDetails(type=error, loc=loc, input=value)]
    )


class _EveryKindJsonSchema:
    """The JSON schema of ``drafter``: one of the kinds' sections, as the registry finds them."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        return {"oneOf": [handler(s.__pydantic_core_schema__) for s in registry.sections().values()]}


# SerializeAsAny: a dump holds the kind's own fields, not only those of the base the field names.
Drafter = Annotated[SerializeAsAny[DrafterSection], BeforeValidator(_drafter_section), _EveryKindJsonSchema()]


class TrainingSection(Section):
    """Optimisation and the torchrun launch."""

    epochs: int = Field(1, ge=1, le=10_000)
    lr: FiniteFloat = Field(3e-4, gt=0, le=10)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: FiniteFloat = Field(0.04, ge=0, lt=1)
    weight_decay: FiniteFloat = Field(0.0, ge=0, le=10)
    grad_clip: FiniteFloat = Field(1.0, gt=0, le=1e6)
    pack_length: int = Field(2048, ge=16, le=MAX_TOKENS, description="Tokens per packed training sequence.")
    batch_size: int = Field(1, ge=1, le=MAX_PARALLEL, description="Packed sequences per process per step.")
    loss: Literal["tokens", "target_logits"] = Field(
        "tokens", description="Cross-entropy to the data's tokens or to the target's distribution."
    )
    feature_noise: FiniteFloat = Field(
        0.0,
        ge=0,
        le=100,
        description="Gaussian noise on the target hidden states the drafter reads in training steps (never "
        "in validation), as a fraction of each token's RMS per layer; 0 = none. A regulariser for small "
        "data sets: the drafter learns not to lean on details of the stored states.",
    )
    loss_positions: Literal["assistant", "all"] = Field(
        "assistant",
        description="Tokens the training loss is taken at: the assistant's replies (what the drafter drafts "
        "when served) or every token of each conversation, prompts and chat template included (more "
        "positions from the same data; with loss target_logits each one has the target's distribution "
        "as its label). Validation always counts the assistant's tokens.",
    )
    nproc: int = Field(
        1, ge=1, le=MAX_PARALLEL, description="Processes per node (torchrun --nproc-per-node)."
    )
    nnodes: int = Field(
        1,
        ge=1,
        le=MAX_PARALLEL,
        description="Machines; each runs `draftflow train RECIPE --node-rank K` (K = 0..nnodes-1).",
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of torchrun's c10d rendezvous when nnodes > 1; node 0 runs on that host "
        "and opens it.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    log_every: int = Field(10, ge=1, le=MAX_COUNT)
    checkpoint_every: int = Field(0, ge=0, le=MAX_COUNT, description="Steps; 0 = only at each epoch end.")
    validation_fraction: FiniteFloat = Field(
        0.05,
        ge=0,
        lt=1,
        description="Share of the stored train samples held out (chosen by a hash of the "
        "sample id, never trained on) to measure acceptance during training; 0 = no validation.",
    )
    validation_max_samples: int = Field(
        64, ge=0, le=MAX_COUNT, description="At most this many validation samples."
    )
    max_train_samples: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Train on at most this many of the stored train samples (after the validation split): "
        "the ones with the smallest hash of their id, so smaller subsets are inside larger ones. For "
        "learning curves: how validation τ grows with data, before paying for more. None = all.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        le=MAX_COUNT,
        description="Steps between validations besides every epoch end; 0 = epoch ends only.",
    )
    run_dir: str = Field("./draftflow-runs", description="fsspec URL of training runs.")
    run_dir_shared: bool = Field(
        False,
        description="Declares that run_dir, a local path, is the same folder on every node (an NFS or "
        "Lustre mount). Needed for a local run_dir when nnodes > 1: rank 0 writes the checkpoints and "
        "every rank reads them on resume, wherever it runs.",
    )
    max_missing_fraction: FiniteFloat = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of train samples the trainer may leave out when the store lacks them (missing, "
        "failed extraction, broken shard) in offline mode; they are listed in the run's skipped-samples.json.",
    )

    @model_validator(mode="after")
    def _multinode_needs_rendezvous(self) -> TrainingSection:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs `rdzv_endpoint` (host:port of node 0, e.g. head-node:29400)")
        if self.rdzv_endpoint is not None and not re.fullmatch(
            r"(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}", self.rdzv_endpoint
        ):
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} is not host:port (e.g. head-node:29400)")
        if self.rdzv_endpoint is not None and not 1 <= int(self.rdzv_endpoint.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r}: port must be 1..65535")
        if self.nnodes > 1 and _node_local(self.run_dir) and not self.run_dir_shared:
            # Whether a local path is a shared mount cannot be seen from one machine, so the
            # recipe says so; otherwise node 1 would resume from a folder rank 0 never wrote.
            raise ValueError(
                f"run_dir {self.run_dir!r} is a path on one machine, but nnodes={self.nnodes}: every node "
                "must see the same run folder (rank 0 writes the checkpoints, every rank reads them on "
                "resume). Use an object-store URL (s3://…), or set run_dir_shared: true if the path is "
                "a filesystem mounted on every node (NFS, Lustre)"
            )
        return self


class EvaluationSection(Section):
    """Acceptance evaluation on held-out prompts."""

    num_prompts: int = Field(8, ge=1, le=MAX_COUNT)
    max_new_tokens: int = Field(128, ge=1, le=MAX_TOKENS)
    min_acceptance_length: FiniteFloat = Field(
        1.0, ge=1.0, le=1024, description="Gate: publishing needs at least this mean acceptance length."
    )
    agreement_tolerance: FiniteFloat = Field(
        0.10, gt=0, lt=1, description="Allowed relative gap between offline and vLLM acceptance."
    )
    in_vllm: bool = True
    measure_speedup: bool = Field(
        True, description="With in_vllm: also time the target alone (one more server) for the speed-up."
    )
    speed_rounds: int = Field(
        1, ge=1, le=20, description="Speed-up rounds: D T, T D, ... on fresh servers, pooled (README)."
    )
    speed_schedule: Literal["rotated", "interleaved"] = Field(
        "rotated",
        description="rotated: one side's server at a time, whole passes; interleaved (CPU launches): "
        "every side's server up at once (drafter, target, each must_beat baseline), each prompt decoded "
        "on all of them back to back, so host drift hits all alike (only when measure_speedup).",
    )
    prompt_set: Literal["held_out", "draftflow-eval"] = Field(
        "held_out",
        description="held_out: the first `num_prompts` of the data's eval split; draftflow-eval: "
        "the project's own 78 prompts in 6 categories (never trained on), τ reported per category.",
    )
    prompts_per_category: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="draftflow-eval only: the first N prompts of each category; None = all.",
    )
    min_speedup: FiniteFloat | None = Field(
        1.0,
        gt=0,
        le=1024,
        description="Gate: publishing needs the drafter's decode speed-up over the target alone, pooled "
        "over the speed rounds of the same evaluation, at least this; None: not gated. Not gated either "
        "when the speed-up is not measured (in_vllm or measure_speedup false): the report says so.",
    )
    must_beat: list[Literal["ngram", "suffix"]] = Field(
        default_factory=list,
        description="Train-free speculation in vLLM the drafter must beat on speed-up: each is the target "
        "served with it (drafting the drafter's tokens per step), decoded as one more side of the same "
        "speed rounds. ngram: prompt lookup; suffix: suffix decoding (needs arctic_inference in the vLLM "
        "virtualenv). Needs in_vllm and measure_speedup.",
    )

    @model_validator(mode="after")
    def _baselines_need_measurement(self) -> EvaluationSection:
        if self.must_beat and not (self.in_vllm and self.measure_speedup):
            raise ValueError(
                f"evaluation.must_beat {self.must_beat} races the drafter against them in vLLM's speed "
                "rounds: it needs evaluation.in_vllm and evaluation.measure_speedup true"
            )
        if len(set(self.must_beat)) != len(self.must_beat):
            raise ValueError(f"evaluation.must_beat {self.must_beat} has duplicates")
        return self


class PublishSection(Section):
    """Where the finished checkpoint goes."""

    destination: str | None = Field(
        None, description="fsspec URL, or hf://OWNER/REPO for the Hugging Face Hub; None = do not push."
    )
    license: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9.+-]*$",
        description="License id for the model card's Hub metadata (e.g. apache-2.0, as the Hub lists "
        "them); None: the card states none.",
    )


def _check_refresh(recipe: Recipe) -> None:
    if recipe.data.traffic is None:
        raise ValueError(
            "refresh: needs a `traffic` data source (a refresh trains on the newest traffic window)"
        )
    destination = recipe.publish.destination
    if destination is not None and destination.startswith("hf://"):
        raise ValueError(
            "refresh: the drafter in service is read from a release pointer, which an fsspec "
            "publish.destination keeps (not hf://)"
        )


class Recipe(Section):
    """A whole training recipe."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    description: str = ""
    target: TargetSection
    data: DataSection
    extraction: ExtractionSection = ExtractionSection()
    vllm: VLLMSection = VLLMSection()
    drafter: Drafter
    training: TrainingSection = TrainingSection()
    evaluation: EvaluationSection = EvaluationSection()
    publish: PublishSection = PublishSection()
    prefect: PrefectSection = PrefectSection()
    refresh: RefreshSection | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        ids = self.extraction.layer_ids
        if ids is not None:
            _check_layer_list(ids, "extraction.layer_ids")
        ctx = self.drafter.context_layer_ids
        if ctx is not None:
            _check_layer_list(ctx, "drafter.context_layer_ids")
            if ids is not None and not set(ctx) <= set(ids):
                raise ValueError(
                    f"drafter.context_layer_ids {ctx} must be a subset of extraction.layer_ids {ids}"
                )
        if self.refresh is not None:
            _check_refresh(self)
        launch = self.vllm.launch
        if self.evaluation.speed_schedule == "interleaved" and (launch is None or launch.device != "cpu"):
            raise ValueError(
                "evaluation.speed_schedule interleaved runs two launched servers side by side: CPU "
                "launches only (vllm.launch.device: cpu; on a GPU each server reserves "
                "gpu_memory_utilization of the card)"
            )
        if launch is not None and self.data.max_length >= launch.max_model_len:
            raise ValueError(
                f"data.max_length ({self.data.max_length}) must be below "
                f"vllm.launch.max_model_len ({launch.max_model_len}): vLLM needs one token to spare"
            )
        if self.data.max_length > self.training.pack_length:
            raise ValueError(
                f"data.max_length ({self.data.max_length}) exceeds training.pack_length "
                f"({self.training.pack_length}): a sample must fit one packed sequence"
            )
        return self


LOCAL_PROTOCOLS = ("file", "local", "memory")  # fsspec protocols whose folders live on one machine


def _node_local(url: str) -> bool:
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return protocol.split("::")[-1] in LOCAL_PROTOCOLS


def _check_layer_list(ids: list[int], field: str) -> None:
    if not ids:
        raise ValueError(f"{field} must not be empty")
    if any(i < 0 for i in ids):
        raise ValueError(f"{field} {ids} has a negative id")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{field} {ids} has duplicates")
    if ids != sorted(ids):
        raise ValueError(f"{field} {ids} must be sorted ascending")
