"""The toy drafter module (plain PyTorch)."""

from __future__ import annotations

import torch
from torch import nn

from draftflow.models.vocab import DraftVocab


class ToyHeads(nn.Module):
    """k independent heads on fc(aux states) + the bonus token's embedding (Medusa-like)."""

    def __init__(self, hidden: int, num_aux: int, k: int, vocab: DraftVocab):
        super().__init__()
        self.k, self.draft_vocab = k, vocab.draft_vocab_size
        self.embed_tokens = nn.Embedding(vocab.target_vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.heads = nn.Linear(hidden, k * vocab.draft_vocab_size, bias=False)
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)

    def forward(self, aux: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        h = self.fc(aux.flatten(-2).to(self.fc.weight.dtype)) + self.embed_tokens(bonus)
        return self.heads(h).unflatten(-1, (self.k, self.draft_vocab))
