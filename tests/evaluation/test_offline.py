"""The offline simulator on the real SmolLM2 target: exact counts with known proposers, lossless
output with real exported drafters, and the hidden-state convention the drafters are fed."""

from __future__ import annotations

import pytest
import torch
from known_drafters import dflash_checkpoint, eagle3_checkpoint
from proposers import AlwaysWrongProposer, OracleProposer

from draftflow.evaluation.offline import (
    LosslessError,
    TargetRunner,
    check_same_as_greedy,
    evaluate_offline,
    greedy_generate,
    simulate,
)

pytestmark = pytest.mark.slow

EOS = 2  # <|im_end|>
QUESTIONS = ["Write the alphabet with commas between letters.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return [chat_ids(q) for q in QUESTIONS]


def hf_greedy(model, prompt, max_new_tokens):
    """An independent reference: transformers' own greedy generate, stopping at EOS."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return out[0, len(prompt) :].tolist()


def test_aux_states_follow_the_extraction_convention(smollm2_model, prompts):
    runner = TargetRunner(smollm2_model, [0, 2, 15, 30])
    cache = runner.new_cache()
    logits, aux = runner.forward(prompts[0][:-3], cache)
    logits2, aux2 = runner.forward(prompts[0][-3:], cache)  # continued on the KV cache
    with torch.no_grad():
        ref = smollm2_model(torch.tensor([prompts[0]]), output_hidden_states=True)
    hs = [h[0] for h in ref.hidden_states]
    states = torch.cat([aux, aux2])
    for j, layer in enumerate([0, 2, 15]):  # id k < L: the residual stream entering layer k
        torch.testing.assert_close(states[:, j], hs[layer], rtol=0, atol=1e-4)
    # id L = 30: the last layer's output BEFORE the final norm (transformers' last entry is after it)
    last = states[:, 3]
    torch.testing.assert_close(smollm2_model.model.norm(last), hs[30], rtol=0, atol=1e-4)
    assert (last - hs[30]).abs().max() > 1.0
    torch.testing.assert_close(torch.cat([logits, logits2]), ref.logits[0], rtol=0, atol=1e-3)


@pytest.mark.parametrize("k", [3, 5])
def test_oracle_gives_k_plus_one_and_always_wrong_gives_one(smollm2_model, prompts, k):
    n = 16
    runner = TargetRunner(smollm2_model)
    # the continuation past max_new_tokens and past EOS: vLLM counts acceptances there too
    continuations = [greedy_generate(runner, p, n + k).tokens for p in prompts]
    oracle = simulate(
        smollm2_model, OracleProposer(continuations, k), prompts, max_new_tokens=n, stop_ids=[EOS]
    )
    r = oracle.report
    assert r.mean_acceptance_length == k + 1 and r.acceptance_rate == 1.0
    assert r.accepted_per_position == [r.drafts] * k and r.per_position == [1.0] * k
    assert [o[-1] == EOS for o in oracle.outputs] == [False, True]  # the second answer ends before 16 tokens
    assert [p.generated_tokens for p in r.per_prompt] == [n, continuations[1].index(EOS) + 1]
    # one draft per k+1 tokens after the prefill's token, rounded up
    assert [p.drafts for p in r.per_prompt] == [-(-(len(o) - 1) // (k + 1)) for o in oracle.outputs]

    wrong = simulate(
        smollm2_model, AlwaysWrongProposer(continuations, k, 49152), prompts, max_new_tokens=n, stop_ids=[EOS]
    )
    w = wrong.report
    assert w.mean_acceptance_length == 1.0 and w.accepted_tokens == 0 and w.accepted_per_position == [0] * k
    assert [p.drafts for p in w.per_prompt] == [len(o) - 1 for o in wrong.outputs]
    assert wrong.outputs == oracle.outputs


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_real_exported_drafter_output_equals_target_greedy(
    smollm2_model, smollm2_dir, prompts, tmp_path, kind
):
    n = 16
    if kind == "dflash":
        folder = dflash_checkpoint(smollm2_dir, tmp_path / kind, block_size=4, draft_vocab_size=4096)
    else:
        folder = eagle3_checkpoint(smollm2_dir, tmp_path / kind, speculative_tokens=3)
    result = evaluate_offline(
        folder,
        prompts,
        max_new_tokens=n,
        stop_ids=[EOS],
        model=smollm2_model,
        prompt_names=["alphabet", "france"],
    )
    assert result.outputs == [hf_greedy(smollm2_model, p, n) for p in prompts]
    r = result.report
    assert r.source == "offline" and r.drafter == kind and r.draft_length == 3 and r.outputs_identical == 2
    assert [p.prompt_id for p in r.per_prompt] == ["alphabet", "france"]
    assert r.drafts == sum(p.drafts for p in r.per_prompt) and r.draft_tokens == 3 * r.drafts


def test_a_different_output_raises_with_the_logit_gap(smollm2_model, prompts):
    runner = TargetRunner(smollm2_model)
    right = greedy_generate(runner, prompts[1], 6, [EOS]).tokens
    wrong = right[:3] + [right[3] + 1] + right[4:]
    with pytest.raises(LosslessError, match=r"prompt p: .* at generated token 3: .*top-2 logit gap there is"):
        check_same_as_greedy(runner, prompts[1], wrong, 6, [EOS], "p")
