"""Reading single tensors of the target ("verifier") model, and the target's output head.

Drafters reuse the target's token embedding and output head, and the ``target_logits`` loss
needs the target's final norm and lm_head. Those tensors are read by name with
``safetensors.safe_open`` (one file or a sharded ``model.safetensors.index.json``), never by
loading the whole model.

:class:`TargetHead` turns the stored last-layer state (extraction id L, before the final
norm) into the target's logits over the draft vocabulary: ``lm_head(final_norm(h))``
restricted to the draft rows. Gemma-family targets use a ``(1 + w)`` norm and optional
final logit soft-capping; both are read from the target's config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from draftflow.models.vocab import DraftVocab

_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
_HEAD_PREFIXES = ("", "language_model.", "model.language_model.")


def resolve_model_dir(name_or_path: str) -> Path:
    """A local folder, or a hub id already in the local Hugging Face cache (never downloads)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, local_files_only=True))


def read_config(model_dir: str | Path) -> dict:
    """The target's config.json (text_config for multimodal configs, keeping model_type)."""
    cfg = json.loads((resolve_model_dir(str(model_dir)) / "config.json").read_text())
    text = dict(cfg.get("text_config") or cfg)
    text.setdefault("model_type", cfg.get("model_type", ""))
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def _weight_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({name: file for name in f.keys()})
    return out


def read_tensor(model_dir: str | Path, candidates: list[str]) -> tuple[str, Tensor]:
    """The first of ``candidates`` present in the target's safetensors, as (name, tensor)."""
    from safetensors import safe_open

    root = resolve_model_dir(str(model_dir))
    weight_map = _weight_map(root)
    for name in candidates:
        if name in weight_map:
            with safe_open(str(weight_map[name]), "pt") as f:
                return name, f.get_tensor(name)
    raise KeyError(f"{root}: none of {candidates} in the safetensors files")


def load_embeddings(model_dir: str | Path) -> Tensor:
    """[vocab, H] the target's input token embedding."""
    return read_tensor(model_dir, [p + "embed_tokens.weight" for p in _PREFIXES])[1]


def load_lm_head(model_dir: str | Path) -> Tensor:
    """[vocab, H] the target's output head (the embedding when the target ties them)."""
    cfg = read_config(model_dir)
    try:
        return read_tensor(model_dir, [p + "lm_head.weight" for p in _HEAD_PREFIXES])[1]
    except KeyError:
        if cfg.get("tie_word_embeddings", True):
            return load_embeddings(model_dir)
        raise


def load_final_norm(model_dir: str | Path) -> Tensor:
    """[H] the target's final RMSNorm weight as stored."""
    return read_tensor(model_dir, [p + "norm.weight" for p in _PREFIXES])[1]


def load_decoder_layer(model_dir: str | Path, layer: int, names: list[str]) -> dict[str, Tensor]:
    """The target decoder layer ``layer``'s tensors among ``names`` (relative to the layer, e.g.
    ``self_attn.q_proj.weight``); names the target does not have are left out. Norm weights
    come back as the factor they multiply by (Gemma's ``1 + w`` resolved)."""
    offset = norm_offset(read_config(model_dir))
    out = {}
    for name in names:
        try:
            _, tensor = read_tensor(model_dir, [f"{p}layers.{layer}.{name}" for p in _PREFIXES])
        except KeyError:
            continue
        out[name] = tensor + offset if "norm" in name else tensor
    return out


def norm_offset(cfg: dict) -> float:
    """Gemma-family RMSNorms scale by ``1 + w``; the others by ``w``."""
    return 1.0 if str(cfg.get("model_type", "")).startswith("gemma") else 0.0


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """The target's RoPE base. Drafters use *default* RoPE with this base whatever the
    target's scaling (llama3, yarn, ...): the drafter's RoPE is its own, and the checkpoint
    records ``rope_type: default`` so vLLM rotates exactly as training did."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" not in params:  # per-layer-type (Gemma)
        nested = [v for v in params.values() if isinstance(v, dict) and "rope_theta" in v]
        params = params.get("full_attention", nested[0]) if nested else params
    return float(params.get("rope_theta") or cfg.get("rope_theta") or default)


class TargetHead(nn.Module):
    """Frozen ``lm_head(final_norm(h))`` of the target, over the draft vocabulary only."""

    def __init__(
        self,
        norm_weight: Tensor,
        head_rows: Tensor,
        eps: float,
        *,
        norm_offset: float = 0.0,
        softcap: float | None = None,
    ):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.float())
        self.register_buffer("head", head_rows.float())  # [draft_vocab, H]
        self.eps = eps
        self.norm_offset = norm_offset
        self.softcap = softcap

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, vocab: DraftVocab | None = None) -> TargetHead:
        cfg = read_config(model_dir)
        head = load_lm_head(model_dir)
        if vocab is not None:
            if vocab.target_vocab_size != head.shape[0]:
                raise ValueError(
                    f"draft vocab is over {vocab.target_vocab_size} tokens, target has {head.shape[0]}"
                )
            head = head[vocab.target_ids()]
        return cls(
            load_final_norm(model_dir),
            head,
            float(cfg.get("rms_norm_eps", 1e-6)),
            norm_offset=norm_offset(cfg),
            softcap=cfg.get("final_logit_softcapping"),
        )

    @torch.no_grad()
    def forward(self, last_hidden: Tensor) -> Tensor:
        """last_hidden [..., H] (before the final norm) → logits [..., draft_vocab] fp32."""
        x = last_hidden.float()
        x = (
            x
            * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            * (self.norm_weight + self.norm_offset)
        )
        logits = x @ self.head.T
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def use_rows_of(self, weight: Tensor) -> bool:
        """Read the head rows from ``weight``, a drafter's frozen head holding the same rows
        (DFlash's, Eagle3's when frozen), instead of keeping a copy: the matrix is held once
        (at a 4,096-wide target with a 32k draft vocabulary, 0.5 GB of fp32 less). False,
        and nothing changed, unless ``weight`` is frozen and equal to these rows."""
        same = (
            not weight.requires_grad
            and weight.dtype == self.head.dtype
            and weight.device == self.head.device
            and torch.equal(weight, self.head)
        )
        if same:
            self.head = weight.detach()
        return same

    def shares_rows_with(self, weight: Tensor) -> bool:
        return self.head.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()

    @torch.no_grad()
    def probs_at(
        self, last_hidden: Tensor, index: Tensor, keep: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The target's distributions at ``index`` [Bt, N] (positions into the T axis of
        ``last_hidden`` [Bt, T, H]), each distinct position computed once.

        Returns probs [U, draft_vocab] (softmax of :meth:`forward`, fp32) over the U <= Bt·T
        distinct (row, position) pairs, and rows [Bt, N] with
        ``probs[rows[b, n]] == softmax(self(last_hidden[b, index[b, n]]))`` wherever
        ``keep`` [Bt, N] (default: everywhere; elsewhere rows are 0 and nothing is computed).
        Blocks overlap (A·(B-1) items, at most T positions): up to (B-1)x less head work.
        """
        bt, t, h = last_hidden.shape
        flat = (index + torch.arange(bt, device=index.device)[:, None] * t).reshape(-1)
        rows = torch.zeros_like(flat)
        kept = keep.reshape(-1) if keep is not None else torch.ones_like(flat, dtype=torch.bool)
        unique, rows[kept] = torch.unique(flat[kept], return_inverse=True)
        probs = self(last_hidden.reshape(bt * t, h)[unique])  # softmax in place: one [U, V] buffer
        # 64 rows at a time: ATen's softmax makes its passes over each row while it is in cache,
        # where five whole-tensor in-place passes went to memory (2x faster at U = 4,688)
        for s in range(0, probs.shape[0], 64):
            probs[s : s + 64] = torch.softmax(probs[s : s + 64], -1)
        return probs, rows.view(index.shape)
