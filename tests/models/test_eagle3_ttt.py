"""Eagle3 training-time test against a naive loop that drafts like vLLM, one anchor at a time."""

from __future__ import annotations

import warnings

import pytest
import torch

from draftflow.models.common import PackedBatch
from draftflow.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftflow.models.eagle3.attention import ttt_attention

STEPS = 3


def tiny_config(**kw) -> Eagle3Config:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=97,
        draft_vocab_size=97,
        num_aux_layers=2,
        rope_theta=10000.0,
    )
    return Eagle3Config(**{**base, **kw})


def packed_example():
    g = torch.Generator().manual_seed(0)
    doc = torch.tensor([[0] * 7 + [1] * 10 + [2] * 5, [3] * 12 + [4] * 10])
    ids = torch.randint(5, 97, doc.shape, generator=g)
    return PackedBatch(ids, torch.randn(2, 22, 2, 32, generator=g), torch.ones_like(ids), doc)


def naive_layer_pass(model, token, hidden, pos, keys, values):
    """One decoder-layer pass for ONE query (as vLLM's Eagle3 layer), attending to the given
    explicit key/value list plus its own key. Returns (prenorm output, own key, own value)."""
    layer, attn = model.layers[0], model.layers[0].self_attn
    e = layer.input_layernorm(model.embed_tokens(token))
    h = layer.hidden_norm(hidden)
    residual = h if layer.norm_before_residual else hidden
    x = torch.cat([e, h], -1)
    rope = model.rotary
    q = rope(attn.q_proj(x).view(1, attn.nh, attn.hd), pos.view(1))[0]
    k = rope(attn.k_proj(x).view(1, attn.nkv, attn.hd), pos.view(1))[0]
    v = attn.v_proj(x).view(attn.nkv, attn.hd)
    ks, vs = torch.stack(keys + [k]), torch.stack(values + [v])  # [n, nkv, hd]
    g = attn.nh // attn.nkv
    out = torch.stack(
        [torch.softmax(ks[:, i // g] @ q[i] / attn.hd**0.5, 0) @ vs[:, i // g] for i in range(attn.nh)]
    )
    x = residual + attn.o_proj(out.flatten())
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v


def naive_draft(model, batch, b, i, steps):
    """vLLM's schedule for anchor i: a first pass over the document up to i (token t+1 with the
    target's fused state t, causal), then steps k>=1 at position pos[i]+k feeding the previous
    output and token i+1+k, attending to the first pass's keys and the earlier steps' keys."""
    start, _, pos = batch.documents()
    s = int(start[b, i])
    g = model.combine_hidden_states(batch.hidden_states[b : b + 1])[0]
    ids = batch.input_ids[b]
    keys, values, out = [], [], None
    for t in range(s, i + 1):  # first pass: each position sees the first pass's keys <= itself
        token = ids[t + 1] if t + 1 < len(ids) else torch.tensor(0)
        out, k, v = naive_layer_pass(model, token, g[t], pos[b, t], keys, values)
        keys, values = keys + [k], values + [v]
    outs = [out]
    for step in range(1, steps):
        token = ids[i + 1 + step] if i + 1 + step < len(ids) else torch.tensor(0)
        out, k, v = naive_layer_pass(model, token, out, pos[b, i] + step, keys, values)
        keys, values = keys + [k], values + [v]
        outs.append(out)
    return outs


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_ttt_steps_equal_naive_vllm_style_drafting(norm_before_residual):
    torch.manual_seed(0)
    batch = packed_example()
    model = Eagle3Drafter(tiny_config(norm_before_residual=norm_before_residual)).eval()
    with torch.no_grad():
        model.layers[0].hidden_norm.weight.normal_()  # make the two residual conventions differ
        start, _, pos = batch.documents()
        outs = model.forward_ttt(batch.input_ids, batch.hidden_states, pos, start, STEPS)
        for b in range(2):
            for i in range(22):
                ref = naive_draft(model, batch, b, i, STEPS)
                for step in range(STEPS):
                    torch.testing.assert_close(outs[step][b, i], ref[step], rtol=0, atol=2e-5)


def test_ttt_step_never_sees_other_documents_or_other_anchors_drafts():
    """d out(step k, index i) / d target state j is non-zero only for j in i's document, j <= i."""
    torch.manual_seed(0)
    batch = packed_example()
    model = Eagle3Drafter(tiny_config())
    start, _, pos = batch.documents()
    hidden = batch.hidden_states.clone().requires_grad_(True)
    outs = model.forward_ttt(batch.input_ids, hidden, pos, start, STEPS)
    for step in range(STEPS):
        for b, i in [(0, 3), (0, 9), (1, 11), (1, 21)]:
            (grad,) = torch.autograd.grad(outs[step][b, i].sum(), hidden, retain_graph=True)
            seen = grad.abs().flatten(2).amax(-1) > 0
            expected = torch.zeros_like(seen)
            expected[b, int(start[b, i]) : i + 1] = True
            assert torch.equal(seen, expected), (step, b, i)


def test_ttt_attention_flex_equals_dense_forward():
    torch.manual_seed(0)
    t, nh, nkv, hd = 22, 4, 2, 8
    q, k0, v0 = torch.randn(2, t, nh, hd), torch.randn(2, t, nkv, hd), torch.randn(2, t, nkv, hd)
    prev = [torch.randn(2, t, nkv, hd) for _ in range(2)]
    start, _, _ = packed_example().documents()
    hi = torch.arange(1, t + 1).expand(2, t)
    dense = ttt_attention(q, k0, v0, prev, prev, start, hi, 0.3, "dense")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = ttt_attention(q, k0, v0, prev, prev, start, hi, 0.3, "flex")
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)


def test_propose_equals_ttt_when_drafts_match_the_data():
    """propose() (vLLM's chain) and forward_ttt (teacher forcing) agree at the last index when
    the data tokens are the drafts themselves."""
    torch.manual_seed(0)
    model = Eagle3Drafter(tiny_config()).eval()
    t = 9
    ids = torch.randint(5, 97, (1, t))
    aux = torch.randn(1, t, 2, 32)
    drafts = model.propose(aux[:, :-1], ids[:, :-1], ids[:, -1], STEPS)  # context = first t-1 tokens
    full = torch.cat([ids, drafts], 1)  # data = context + next token + the drafts
    aux_full = torch.cat([aux, torch.randn(1, STEPS, 2, 32)], 1)
    with torch.no_grad():
        pos = torch.arange(full.shape[1])[None]
        outs = model.forward_ttt(full, aux_full, pos, torch.zeros_like(pos), STEPS)
        ttt = [model.vocab.to_target(model.compute_logits(o[0, t - 2]).argmax(-1)) for o in outs]
    assert torch.stack(ttt).tolist() == drafts[0].tolist()


def test_ttt_chunked_sdpa_path_equals_the_log_sum_exp_reference_with_gradient():
    from draftflow.models.common import document_bounds
    from draftflow.models.eagle3.attention import ttt_attention_chunked, ttt_attention_merged

    g = torch.Generator().manual_seed(3)
    doc = torch.tensor([[0] * 9 + [1] * 14 + [2] * 7, [3] * 20 + [4] * 10])
    start, _ = document_bounds(doc)
    hi = torch.arange(1, 31).expand(2, 30)
    for steps in (0, 2):
        leaves = [torch.randn(2, 30, 4, 8, generator=g, requires_grad=True)]
        leaves += [torch.randn(2, 30, 2, 8, generator=g, requires_grad=True) for _ in range(2 + 2 * steps)]
        q, k0, v0, *prev = leaves
        weights = torch.randn(2, 30, 4, 8, generator=g)
        results = []
        for fn, kw in ((ttt_attention_chunked, {"max_chunk_queries": 7}), (ttt_attention_merged, {})):
            out = fn(q, k0, v0, prev[:steps], prev[steps:], start, hi, 0.3, **kw)
            results.append((out, torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)))
        (fast, fast_grads), (ref, ref_grads) = results
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(fast_grads, ref_grads):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["dense", "flex"])
def test_ttt_on_some_rows_equals_the_full_unroll_at_those_rows(impl):
    """forward_ttt(rows=...) (queries and chains at some indices, step-0 keys at all) gives
    the full unroll's outputs at those indices, and on the dense path the same gradients."""
    torch.manual_seed(2)
    batch = packed_example()
    model = Eagle3Drafter(tiny_config())
    model.attn_impl = impl
    start, _, pos = batch.documents()
    rows = torch.tensor([2, 3, 4, 9, 10, 11, 12, 16, 18, 21])
    weights = [torch.randn(2, rows.numel(), 32) for _ in range(STEPS)]
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    with warnings.catch_warnings(), torch.set_grad_enabled(impl == "dense"):  # flex: no CPU backward
        warnings.simplefilter("ignore")
        for some in (None, rows):
            outs = model.forward_ttt(batch.input_ids, batch.hidden_states, pos, start, STEPS, some)
            outs = [o if some is not None else o[:, rows] for o in outs]
            loss = sum((o * w).sum() for o, w in zip(outs, weights))
            grads = torch.autograd.grad(loss, params, allow_unused=True) if impl == "dense" else ()
            results.append(([o.detach() for o in outs], grads))
    (full, g_full), (some, g_some) = results
    for a, b in zip(some, full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(g_some, g_full):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
