"""Eagle3 activation checkpointing across TTT steps: the same loss and gradients, and what a step keeps
for the backward pass is only the state the next step reads (its output and its keys), so peak memory
grows far slower than the number of steps. Both measures are deterministic: the distinct storages
autograd saves (weights left out: held whatever the step count), and the peak of the bytes of live
tensors made by any operation of the forward and backward pass (recomputation included)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from draftflow.models.common import PackedBatch
from draftflow.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftflow.models.eagle3.model import eagle3_loss
from draftflow.models.target_weights import TargetHead
from draftflow.paths import CHECKPOINT_COMPLETE, RunLayout
from draftflow.recipe.load import load_recipe
from draftflow.train.run_state import check_settings, run_settings

HIDDEN, KV = 32, 2 * 8  # hidden size; num_kv_heads x head_dim
EAGLE3_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama-3.1-8b-eagle3.yaml"


def _model_and_batch(t: int = 40) -> tuple[Eagle3Drafter, PackedBatch]:
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=HIDDEN,
        intermediate_size=112,  # ~3.5 x hidden, as the Llama targets
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=256,
        draft_vocab_size=256,  # >> hidden, as a 32k draft vocabulary is to a 4k hidden size
        num_aux_layers=3,
    )
    g = torch.Generator().manual_seed(1)
    doc = torch.tensor([[0] * (t // 2) + [1] * (t - t // 2)])
    ids = torch.randint(5, 256, doc.shape, generator=g)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # a prompt
    hidden = torch.randn(1, t, 3, HIDDEN, generator=g)
    last = torch.randn(1, t, HIDDEN, generator=g)
    return Eagle3Drafter(cfg), PackedBatch(ids, hidden, mask, doc, None, last)


def _loss_grads_and_saved_bytes(model, batch, steps: int, **loss_kw):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = eagle3_loss(model, batch, steps=steps, decay=0.8, **loss_kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads, sum(saved.values())


class PeakLiveBytes(TorchDispatchMode):
    """The most bytes held at once by storages that operations under this mode created."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _peak_bytes(checkpoint_steps: bool, steps: int) -> int:
    model, batch = _model_and_batch()
    model.checkpoint_steps = checkpoint_steps
    with PeakLiveBytes() as tracker:
        eagle3_loss(model, batch, steps=steps, decay=0.8).loss.backward()
    return tracker.peak


@pytest.mark.parametrize("loss", ["tokens", "target_logits"])
def test_checkpointed_steps_give_the_same_loss_metrics_and_gradients(loss):
    plain, batch = _model_and_batch()
    kw = {}
    if loss == "target_logits":
        head = TargetHead(torch.ones(HIDDEN), torch.randn(256, HIDDEN), 1e-6)
        kw = {"loss": loss, "target_head": head}
    recomputed = copy.deepcopy(plain)
    recomputed.checkpoint_steps = True
    a, grads_a, bytes_a = _loss_grads_and_saved_bytes(plain, batch, 4, **kw)
    b, grads_b, bytes_b = _loss_grads_and_saved_bytes(recomputed, batch, 4, **kw)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.metrics.correct, a.metrics.correct, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys() and {"fc.weight", "lm_head.weight"} <= grads_a.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)
    assert bytes_b < 0.5 * bytes_a, (bytes_b, bytes_a)


def test_memory_kept_for_backward_grows_by_only_the_carried_state_per_ttt_step():
    model, batch = _model_and_batch()
    t = batch.input_ids.shape[1]
    plain = {n: _loss_grads_and_saved_bytes(model, batch, n)[2] for n in (1, 2, 4, 8)}
    model.checkpoint_steps = True
    kept = {n: _loss_grads_and_saved_bytes(model, batch, n)[2] for n in (1, 2, 4, 8)}
    # Without checkpointing every step keeps its layer's and head's activations (and a growing stack
    # of earlier keys): at least linear in the steps.
    assert plain[8] > 6 * plain[1], plain
    # With it, a step keeps what the next one reads: its output and its key/value, (H + 2·kv) floats per
    # token (and a few index tensors).
    per_step = [(kept[b] - kept[a]) / (b - a) for a, b in ((1, 2), (2, 4), (4, 8))]
    carried = t * (HIDDEN + 2 * KV) * 4
    assert all(s <= 1.25 * carried for s in per_step), (per_step, carried)


def test_peak_memory_grows_sub_linearly_in_ttt_steps_with_checkpointing():
    plain = {n: _peak_bytes(False, n) for n in (1, 8)}
    recomputed = {n: _peak_bytes(True, n) for n in (1, 8)}
    assert plain[8] > 3 * plain[1], plain  # the measure sees the steps' activations
    assert recomputed[8] < 2 * recomputed[1], recomputed  # eight steps: less than twice one step's peak
    assert recomputed[8] < 0.5 * plain[8], (recomputed, plain)


def test_the_recipe_switch_is_not_compared_on_resume(tmp_path):
    recipe = load_recipe(EAGLE3_RECIPE, ["drafter.activation_checkpointing=true"])
    assert recipe.drafter.activation_checkpointing is True
    layout = RunLayout(str(tmp_path / "run"))
    step = Path(layout.checkpoint(2))
    step.mkdir(parents=True)
    (step / CHECKPOINT_COMPLETE).write_text("{}")  # the run has state a resume would continue
    before = run_settings(load_recipe(EAGLE3_RECIPE), 1, [])
    before["drafter"].pop("activation_checkpointing", None)  # as recorded before the switch existed
    check_settings(layout, before)
    check_settings(layout, run_settings(recipe, 1, []))  # switched on for the resume: not refused
