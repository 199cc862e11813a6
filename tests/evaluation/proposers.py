"""Test doubles for the offline simulator: proposers whose acceptance is known in advance."""

from __future__ import annotations

from collections.abc import Sequence

from draftflow.models.algorithm import DraftState


class OracleProposer:
    """Proposes the target's own greedy continuation: every draft is accepted (τ = k + 1).

    ``continuations[i]`` is the target's greedy output for prompt i, long enough to cover
    ``max_new_tokens + k`` (vLLM counts acceptances past ``max_new_tokens``); positions past
    its end are filled with token 0.
    """

    name = "oracle"
    aux_layer_ids: Sequence[int] = ()

    def __init__(self, continuations: Sequence[Sequence[int]], draft_length: int):
        self.continuations = [list(c) for c in continuations]
        self.draft_length = int(draft_length)

    def _ahead(self, state: DraftState) -> list[int]:
        known = self.continuations[state.prompt_index][
            state.num_generated : state.num_generated + self.draft_length
        ]
        return known + [0] * (self.draft_length - len(known))

    def propose(self, state: DraftState) -> list[int]:
        return self._ahead(state)


class AlwaysWrongProposer(OracleProposer):
    """Proposes, first, a token the target does not predict: nothing is ever accepted (τ = 1)."""

    name = "always-wrong"

    def __init__(self, continuations: Sequence[Sequence[int]], draft_length: int, vocab_size: int):
        super().__init__(continuations, draft_length)
        self.vocab_size = int(vocab_size)

    def propose(self, state: DraftState) -> list[int]:
        ahead = self._ahead(state)
        return [(ahead[0] + 1) % self.vocab_size] + ahead[1:]
