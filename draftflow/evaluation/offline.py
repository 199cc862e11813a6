"""The offline acceptance simulator: greedy speculative decoding with the target in transformers.

Per prompt (token ids):

1. Prefill the target; generation starts with its greedy token (the first "bonus" token).
2. Each step a proposer drafts ``k`` tokens from the target states of every token the target
   has processed and the bonus token it has not (DFlash: one block, ``k = block_size - 1``;
   Eagle3: a chain of ``k = speculative_tokens``).
3. The target verifies ``[bonus, d1..dk]`` in ONE forward pass over its KV cache; accepted =
   the longest prefix of drafts equal to the target's own greedy predictions, then the target's
   next prediction is the new bonus token. Rejected positions are cropped from the cache.
4. Stop at ``max_new_tokens`` or a stop token, counting as vLLM's scheduler does: one draft per
   verification step, accepted tokens counted in full even past ``max_new_tokens`` or past a
   stop token (the output is cut afterwards).

The output must equal the target's plain greedy output (one token per forward pass); a
mismatch raises :class:`LosslessError`, with the target's top-2 logit gap at that token so a
numerical near-tie is told apart from a bug.

Target hidden states follow the extraction convention: id ``k < L`` is the residual stream
entering layer ``k`` = transformers' ``hidden_states[k]``; id ``L`` is the last layer's output
before the final norm (a forward hook on the last decoder layer; transformers' last
``hidden_states`` entry is after the norm).

Proposers are pluggable (:class:`Proposer`): the drafter loaded from an exported checkpoint
folder (:func:`checkpoint_proposer`, the files vLLM reads); the tests add an oracle that knows
the target's greedy continuation and a proposer that is always wrong.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from draftflow.evaluation.report import AcceptanceReport, PromptAcceptance
from draftflow.models import checkpoint_info, load_drafter
from draftflow.models.algorithm import DrafterAlgorithm, DraftState
from draftflow.models.target_weights import resolve_model_dir


class DraftLengthError(ValueError):
    """A draft length the checkpoint's kind cannot serve (a DFlash length beyond its block)."""


class LosslessError(AssertionError):
    """Speculative decoding produced another output than the target's plain greedy decoding."""


class Proposer(Protocol):
    name: str
    draft_length: int
    aux_layer_ids: Sequence[int]  # target layers (extraction convention) the proposer reads

    def propose(self, state: DraftState) -> list[int]:
        """``draft_length`` target token ids that would follow ``state.tokens``."""


# ---------------------------------------------------------------------------------------
# The target
# ---------------------------------------------------------------------------------------


def load_target(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """The target as transformers loads it (fp32 on CPU by default), in eval mode."""
    from transformers import AutoModelForCausalLM  # heavy: only when a target is loaded

    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(str(model_dir)), dtype=dtype).eval()


def _decoder_layers(model) -> Sequence[torch.nn.Module]:
    return model.get_decoder().layers


class TargetRunner:
    """Forward passes of the target over a KV cache, returning logits and the aux layer states."""

    def __init__(self, model, aux_layer_ids: Sequence[int] = ()):
        self.model = model
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        # transformers 5.x renames the cache argument (`past_key_values` is deprecated there)
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.can_keep_last = "logits_to_keep" in params
        bad = [i for i in self.aux_layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(
                f"aux layer ids {bad} outside 0..{self.num_layers} for a {self.num_layers}-layer target"
            )

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    @torch.no_grad()
    def forward(
        self, token_ids: Sequence[int], cache, last_only: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Feed ``token_ids`` after what ``cache`` holds → logits [n, V] (or [1, V] with
        ``last_only``), aux states [n, n_aux, H]."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.model.device)
        extra = {"logits_to_keep": 1} if last_only and self.can_keep_last else {}
        captured: dict[str, Tensor] = {}
        hook = None
        if self.num_layers in self.aux_layer_ids:

            def keep(_module, _inputs, output):
                captured["last"] = output[0] if isinstance(output, tuple) else output

            hook = _decoder_layers(self.model)[-1].register_forward_hook(keep)
        try:
            out = self.model(
                input_ids=ids,
                use_cache=True,
                output_hidden_states=bool(self.aux_layer_ids),
                **{self.cache_arg: cache},
                **extra,
            )
        finally:
            if hook is not None:
                hook.remove()
        aux = None
        if self.aux_layer_ids:
            states = [
                captured["last"] if i == self.num_layers else out.hidden_states[i] for i in self.aux_layer_ids
            ]
            aux = torch.stack([s[0] for s in states], 1).float()  # [n, n_aux, H]
        return out.logits[0].float(), aux


@dataclass
class GreedyOutput:
    tokens: list[int]
    top2_gaps: list[float]  # the target's top-1 minus top-2 logit at each generated token


def greedy_generate(
    runner: TargetRunner, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> GreedyOutput:
    """The target's plain greedy output: one token per forward pass, the reference for losslessness."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    plain = TargetRunner(runner.model)  # no aux states needed
    cache = plain.new_cache()
    logits, _ = plain.forward(prompt, cache, last_only=True)
    tokens, gaps = [], []
    while True:
        top = logits[-1].topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        if len(tokens) >= max_new_tokens or tokens[-1] in stop_ids:
            return GreedyOutput(tokens, gaps)
        logits, _ = plain.forward(tokens[-1:], cache)


def truncate_output(tokens: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> list[int]:
    """What a server returns: at most ``max_new_tokens``, up to and including the first stop token."""
    out = list(tokens[:max_new_tokens])
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1]
    return out


# ---------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------


@dataclass
class PromptRun:
    output: list[int]
    drafts: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


def speculative_generate(
    runner: TargetRunner,
    proposer: Proposer,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    prompt_index: int = 0,
) -> PromptRun:
    """Greedy speculative decoding of one prompt, counted as vLLM counts (see the module doc)."""
    k = int(proposer.draft_length)
    if k < 1:
        raise ValueError("draft_length must be >= 1")
    prompt = [int(t) for t in prompt]
    stops = set(int(s) for s in stop_ids)
    cache = runner.new_cache()
    logits, aux = runner.forward(prompt, cache, last_only=True)
    generated = [int(logits[-1].argmax())]
    states = [aux] if aux is not None else []
    run = PromptRun(output=[], accepted_per_position=[0] * k)
    while len(generated) < max_new_tokens and not stops.intersection(generated):
        state = DraftState(
            prompt_index, prompt + generated, len(prompt), torch.cat(states) if states else None
        )
        draft = [int(t) for t in proposer.propose(state)]
        if len(draft) != k:
            raise ValueError(f"proposer {proposer.name} returned {len(draft)} tokens, expected {k}")
        logits, aux = runner.forward([generated[-1]] + draft, cache)
        predicted = logits.argmax(-1).tolist()  # [k + 1]: the target's next token after each fed token
        accepted = 0
        while accepted < k and draft[accepted] == predicted[accepted]:
            accepted += 1
        run.drafts += 1
        run.accepted += accepted
        for i in range(accepted):
            run.accepted_per_position[i] += 1
        generated += draft[:accepted] + [predicted[accepted]]
        if aux is not None:
            states.append(aux[: accepted + 1])
        if k - accepted:
            cache.crop(-(k - accepted))  # drop the rejected drafts' keys/values
    run.output = truncate_output(generated, max_new_tokens, sorted(stops))
    return run


@dataclass
class OfflineResult:
    report: AcceptanceReport
    outputs: list[list[int]]  # generated token ids per prompt (equal to the target's greedy output)


def simulate(
    model,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    prompt_names: Sequence[str] | None = None,
    check_lossless: bool = True,
) -> OfflineResult:
    """Run :func:`speculative_generate` over ``prompts`` → the offline :class:`AcceptanceReport`."""
    names = list(prompt_names) if prompt_names is not None else [str(i) for i in range(len(prompts))]
    if len(names) != len(prompts):
        raise ValueError("prompt_names and prompts differ in length")
    runner = TargetRunner(model, proposer.aux_layer_ids)
    k = int(proposer.draft_length)
    per_prompt, outputs = [], []
    per_position = [0] * k
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        run = speculative_generate(runner, proposer, prompt, max_new_tokens, stop_ids, prompt_index=i)
        if check_lossless:
            check_same_as_greedy(runner, prompt, run.output, max_new_tokens, stop_ids, name)
        outputs.append(run.output)
        per_position = [a + b for a, b in zip(per_position, run.accepted_per_position)]
        per_prompt.append(
            PromptAcceptance(
                name,
                run.drafts,
                run.accepted,
                len(run.output),
                run.drafts * k,
                list(run.accepted_per_position),
            )
        )
    report = AcceptanceReport(
        source="offline",
        drafter=proposer.name,
        draft_length=k,
        num_prompts=len(prompts),
        drafts=sum(p.drafts for p in per_prompt),
        draft_tokens=sum(p.draft_tokens for p in per_prompt),
        accepted_tokens=sum(p.accepted for p in per_prompt),
        accepted_per_position=per_position,
        per_prompt=per_prompt,
        max_new_tokens=max_new_tokens,
        outputs_identical=len(prompts) if check_lossless else None,
        notes=[
            f"target in transformers ({next(model.parameters()).dtype}, {model.device}), greedy, KV cache"
        ],
    )
    return OfflineResult(report, outputs)


def check_same_as_greedy(
    runner: TargetRunner,
    prompt: Sequence[int],
    output: list[int],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    name: str,
) -> None:
    reference = greedy_generate(runner, prompt, max_new_tokens, stop_ids)
    if output == reference.tokens:
        return
    i = next(
        (j for j, (a, b) in enumerate(zip(output, reference.tokens)) if a != b),
        min(len(output), len(reference.tokens)),
    )
    gaps = reference.top2_gaps
    gap = f"; the target's top-2 logit gap there is {gaps[i]:.2e}" if i < len(gaps) else ""
    raise LosslessError(
        f"prompt {name}: speculative output ({len(output)} tokens) differs from the target's greedy output "
        f"({len(reference.tokens)} tokens) at generated token {i}: "
        f"{output[i] if i < len(output) else 'end'} vs {reference.tokens[i] if i < len(reference.tokens) else 'end'}"
        f"{gap} (a gap near 1e-5 is a numerical near-tie between batched and one-token forwards, not a drafter bug)"
    )


# ---------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------


class DrafterProposer:
    """A drafter of any kind (its :class:`~draftflow.models.algorithm.DrafterAlgorithm`) proposing
    as vLLM runs it."""

    def __init__(self, drafter: DrafterAlgorithm, aux_layer_ids: Sequence[int]):
        drafter.model.eval()
        self.drafter = drafter
        self.aux_layer_ids = list(aux_layer_ids)
        self.draft_length = drafter.speculative_tokens
        self.name = drafter.kind

    def propose(self, state: DraftState) -> list[int]:
        return self.drafter.propose(state)


def checkpoint_proposer(
    folder: str | Path, *, target: str | Path | None = None, draft_length: int | None = None
) -> DrafterProposer:
    """The drafter rebuilt from the exported folder (the files vLLM reads), in fp32; ``draft_length``
    overrides the exported draft length where the kind allows it."""
    drafter = load_drafter(folder, target=target, dtype=torch.float32)
    if draft_length is not None:
        try:
            drafter = type(drafter)(drafter.model, speculative_tokens=draft_length)
        except ValueError as err:
            raise DraftLengthError(f"draft length {draft_length}: {err}") from err
    return DrafterProposer(drafter, checkpoint_info(folder)["aux_layer_ids"])


# ---------------------------------------------------------------------------------------
# Entry point for a checkpoint
# ---------------------------------------------------------------------------------------


def evaluate_offline(
    checkpoint_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    target: str | Path | None = None,
    model=None,
    prompt_names: Sequence[str] | None = None,
    draft_length: int | None = None,
) -> OfflineResult:
    """Offline acceptance of the drafter exported in ``checkpoint_dir`` against its target.

    target: the target folder or hub id (default: the verifier named in config.json); model:
    an already loaded target (transformers) to reuse.
    """
    target = target or checkpoint_info(checkpoint_dir)["verifier"]
    proposer = checkpoint_proposer(checkpoint_dir, target=target, draft_length=draft_length)
    model = model if model is not None else load_target(target)
    return simulate(
        model, proposer, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, prompt_names=prompt_names
    )
