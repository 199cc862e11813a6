"""Draft vocabulary: selection, mapping conventions, determinism, save/load with staleness checks."""

from __future__ import annotations

import pytest
import torch

from draftflow.models.vocab import DraftVocab, build_draft_vocab, load_draft_vocab, save_draft_vocab


def test_top_tokens_by_count_ties_by_smaller_id():
    counts = {7: 5, 3: 5, 9: 1, 2: 8, 4: 5}
    vocab = build_draft_vocab(counts, target_vocab_size=12, draft_vocab_size=3)
    assert vocab.target_ids().tolist() == [2, 3, 4]  # 8, then the 5s by id: 3, 4 (7 loses the tie)
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 3, 4]


def test_mapping_properties():
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (1000,), generator=gen)
    vocab = build_draft_vocab(counts, 1000, 200)
    d2t, t2d = vocab.d2t, vocab.t2d
    target = torch.arange(200) + d2t
    assert d2t.shape == (200,) and t2d.shape == (1000,) and int(t2d.sum()) == 200
    assert (d2t >= 0).all() and (torch.diff(target) > 0).all()  # ascending target ids, d2t non-decreasing
    assert (torch.diff(d2t) >= 0).all()
    assert t2d[target].all()
    assert vocab.to_draft(target).tolist() == list(range(200))
    assert torch.equal(vocab.to_target(torch.arange(200)), target)
    outside = (~t2d).nonzero().flatten()[:5]
    assert (vocab.to_draft(outside) == -1).all()
    assert (vocab.to_draft(torch.tensor([-1, 1000])) == -1).all()
    # every selected token is at least as frequent as every unselected one
    assert counts[t2d].min() >= counts[~t2d].max()


def test_pure_function_of_counts_and_input_forms_agree():
    counts = {i: (i * 37) % 11 for i in range(100)}
    as_list = [counts[i] for i in range(100)]
    a = build_draft_vocab(counts, 100, 30)
    b = build_draft_vocab(as_list, 100, 30)
    c = build_draft_vocab(torch.tensor(as_list), 100, 30)
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.d2t, c.d2t) and torch.equal(a.t2d, c.t2d)


def test_unseen_tokens_fill_by_id_and_full_size_is_identity():
    vocab = build_draft_vocab({50: 3}, 100, 4)
    assert vocab.target_ids().tolist() == [0, 1, 2, 50]
    full = build_draft_vocab({5: 1}, 10, 10)
    assert full.is_identity and (full.d2t == 0).all()
    assert torch.equal(DraftVocab.identity(10).t2d, full.t2d)


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError):
        build_draft_vocab({100: 1}, 100, 3)
    with pytest.raises(ValueError):
        build_draft_vocab({1: -1}, 100, 3)
    with pytest.raises(ValueError):
        build_draft_vocab({1: 1}, 100, 101)


def test_save_load_roundtrip_and_staleness_checks(tmp_path):
    vocab = build_draft_vocab(torch.arange(64), 64, 16)
    path = str(tmp_path / "vocab" / "draft-vocab-16.safetensors")
    save_draft_vocab(vocab, path, fingerprint="abc123")
    loaded = load_draft_vocab(path, draft_vocab_size=16, fingerprint="abc123")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    with pytest.raises(ValueError, match="expected 32"):
        load_draft_vocab(path, draft_vocab_size=32)
    with pytest.raises(ValueError, match="built from data"):
        load_draft_vocab(path, fingerprint="other")


def test_flipped_bit_in_cached_draft_vocab_is_detected_and_rebuilt(tmp_path, smollm2_dir, caplog):
    """vocab/draft-vocab-SIZE.safetensors of a real prepared folder: a flipped bit in d2t (same size,
    valid header) must not become a silently wrong mapping; the trainer rebuilds it from the counts."""
    import yaml

    from draftflow.data.prepare import prepare_recipe
    from draftflow.models.vocab import CorruptDraftVocab
    from draftflow.plan import Plan
    from draftflow.train.drafter import draft_vocab

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "vocab-test",
                "target": {"model": str(smollm2_dir)},
                "data": {
                    "sources": [{"kind": "chatterbot", "max_samples": 40}],
                    "eval_samples": 2,
                    "max_length": 96,
                },
                "extraction": {"store": str(tmp_path / "store")},
                "drafter": {"kind": "dflash", "block_size": 4, "draft_vocab_size": 512},
            }
        )
    )
    plan = Plan.load(str(recipe))
    prepare_recipe(plan.recipe, plan.data)
    built = draft_vocab(plan)
    path = plan.data.draft_vocab(512)
    blob = bytearray(open(path, "rb").read())
    blob[-3] ^= 0x01  # inside the last tensor's data: the header still parses
    open(path, "wb").write(bytes(blob))
    with pytest.raises(CorruptDraftVocab, match="sha256"):
        load_draft_vocab(path, draft_vocab_size=512, fingerprint=plan.fingerprint)
    with caplog.at_level("WARNING"):
        again = draft_vocab(plan)
    assert torch.equal(again.d2t, built.d2t) and torch.equal(again.t2d, built.t2d)
    assert "rebuilt" in caplog.text
    repaired = load_draft_vocab(path, draft_vocab_size=512, fingerprint=plan.fingerprint)  # file rewritten
    assert torch.equal(repaired.d2t, built.d2t)
