"""Validation acceptance during training: the split, and the batched count against a naive loop."""

from __future__ import annotations

import pytest
import torch

from draftflow.models.dflash import DFlashConfig, DFlashDrafter
from draftflow.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftflow.models.vocab import DraftVocab
from draftflow.train import validation

VOCAB, DRAFT_IDS = 97, [10, 11, 12, 13]  # a 4-token draft vocabulary: random drafts hit ~1/4 of the time


def tiny_vocab() -> DraftVocab:
    d2t = torch.tensor([t - i for i, t in enumerate(DRAFT_IDS)])
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    return DraftVocab(d2t, t2d)


def tiny_drafter(kind: str, k: int, block: int | None = None):
    torch.manual_seed(0)
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        draft_vocab_size=len(DRAFT_IDS),
        rope_theta=10000.0,
    )
    if kind == "dflash":
        cfg = DFlashConfig(
            **common, num_layers=2, num_context_layers=2, block_size=block or k + 1, mask_token_id=3
        )
        return DFlashDrafter(cfg, tiny_vocab()).eval()
    return Eagle3Drafter(Eagle3Config(**common, num_aux_layers=2), tiny_vocab()).eval()


def sample(seed: int, t: int = 40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(DRAFT_IDS)[torch.randint(0, 4, (t,), generator=g)]
    hidden = torch.randn(t, 2, 32, generator=g)
    mask = torch.zeros(t, dtype=torch.uint8)
    mask[t // 4 :] = 1  # a prompt, then the response
    greedy = torch.tensor(DRAFT_IDS)[torch.randint(0, 4, (t,), generator=g)]
    return hidden, ids, mask, greedy


def naive_counts(model, kind: str, k: int, hidden, ids, mask, greedy) -> validation.AcceptanceCounts:
    """The evaluator's proposer, one anchor at a time: context x[0..a-1], bonus x[a]; the draft's
    j-th token is accepted while it equals the target's greedy token g[a + j - 1]."""
    counts = validation.AcceptanceCounts(k)
    t = len(ids)
    for a in range(1, t - k + 1):
        if not mask[a]:
            continue
        if kind == "dflash":
            draft = model.propose(hidden[None, :a], ids[a : a + 1], num_tokens=k)[0]
        else:
            draft = model.propose(hidden[None, :a], ids[None, :a], ids[a : a + 1], k)[0]
        run = 0
        while run < k and int(draft[run]) == int(greedy[a + run]):
            run += 1
        counts.drafts += 1
        counts.accepted += run
        for i in range(run):
            counts.accepted_per_position[i] += 1
    return counts


@pytest.mark.parametrize(
    "kind,k,block",
    [("dflash", 3, None), ("dflash", 1, 4), ("dflash", 2, 4), ("eagle3", 3, None)],
    ids=["dflash", "dflash-served-1-of-block-4", "dflash-served-2-of-block-4", "eagle3"],
)
def test_batched_validation_acceptance_equals_a_naive_per_position_loop(kind, k, block):
    model = tiny_drafter(kind, k, block)
    total_naive, total = validation.AcceptanceCounts(k), validation.AcceptanceCounts(k)
    for seed in range(3):
        hidden, ids, mask, greedy = sample(seed, t=30 + 7 * seed)
        total_naive.merge(naive_counts(model, kind, k, hidden, ids, mask, greedy))
        total.merge(validation.sample_counts(model, k, hidden, ids, mask, greedy))
    assert (
        total_naive.accepted > 0 and total_naive.accepted_per_position[min(1, k - 1)] > 0
    )  # not a trivial all-zero case
    assert (total.drafts, total.accepted, total.accepted_per_position) == (
        total_naive.drafts,
        total_naive.accepted,
        total_naive.accepted_per_position,
    )
    assert total.tau == pytest.approx(1 + total_naive.accepted / total_naive.drafts)


def test_counts_follow_the_evaluator_definition():
    runs = torch.tensor([0, 1, 3, 2])
    counts = validation.AcceptanceCounts(3)
    counts.add_runs(runs)
    assert counts.tau == pytest.approx(1 + 6 / 4)  # bonus token + accepted tokens per draft
    assert counts.per_position == [0.75, 0.5, 0.25]  # prefix of length i+1 accepted
    back = validation.AcceptanceCounts.from_tensor(3, counts.as_tensor())
    assert back == counts


def test_validation_split_is_decided_by_sample_id_and_never_trained_on():
    items = [(f"s{i:03d}", 10 + i) for i in range(100)]
    train, held = validation.split_items(items, 0.1, 64)
    assert len(held) == 10 and not set(held) & {sid for sid, _ in train}
    assert len(train) + len(held) == len(items)
    shuffled = list(reversed(items))
    assert sorted(validation.split_items(shuffled, 0.1, 64)[1]) == sorted(held)  # order does not matter
    # one more sample changes at most one membership: ids are judged by their own hash
    grown = validation.split_items(items + [("s999", 5)], 0.1, 64)[1]
    assert len(set(held) - set(grown)) <= 1
    assert validation.split_items(items, 0.5, 3)[1] == held[:3]  # the cap keeps the smallest hashes
    assert validation.split_items(items, 0.0, 64) == (items, [])


def test_a_train_subset_keeps_order_and_smaller_subsets_lie_inside_larger_ones():
    items = [(f"s{i:03d}", 10 + i) for i in range(100)]
    train, _ = validation.split_items(items, 0.1, 64)
    small, large = validation.subset_items(train, 20), validation.subset_items(train, 50)
    assert len(small) == 20 and len(large) == 50
    assert set(small) < set(large) < set(train)
    assert small == [it for it in train if it in set(small)]  # the store's order, not the hash order
    assert validation.subset_items(list(reversed(train)), 20) == list(reversed(small))  # chosen by id alone
    assert validation.subset_items(train, None) == train == validation.subset_items(train, 1000)
