"""Multi-layer DFlash drafts correctly on vLLM's CPU build.

The defect (vLLM 0.32, CPU build only): ``DFlashQwen3Model._normalize_context_k`` normalises the
context keys of every drafter layer with ONE grouped ``ops.rms_norm`` call over the stacked
per-layer ``k_norm`` weights ``[num_layers, head_dim]``. The CUDA kernel picks each layer's row;
the CPU kernel reads only the first row, so layers 1.. get layer 0's ``k_norm``. A DFlash drafter
with more than one layer then proposes other drafts than it was trained to (output stays lossless,
acceptance drops, nothing is logged).

The fix: the same kernel, called once per layer with that layer's own weight row. It is installed
only for drafters with more than one layer (a 1-layer drafter runs the stock code path,
unchanged). The model module is patched when it is imported (an import hook), or at once if it
already is, so a server that never loads a DFlash drafter pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

#: The name draftflow asks for (keep it stable).
FIX = "dflash-cpu-grouped-k-norm"
MODULE = "vllm.model_executor.models.qwen3_dflash"
_PATCHED = "_draftflow_per_layer_k_norm"
log = logging.getLogger("vllm.draftflow_vllm_cpu")  # under "vllm": vLLM's log handlers print it


def install() -> None:
    """Patch the model module now if it is imported, else when it is."""
    module = sys.modules.get(MODULE)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def patch(module) -> bool:
    """Replace ``DFlashQwen3Model._normalize_context_k`` in ``module``; False if this vLLM has none."""
    model = getattr(module, "DFlashQwen3Model", None)
    stock = getattr(model, "_normalize_context_k", None)
    if stock is None:
        log.warning(
            "draftflow-vllm-cpu: %s has no DFlashQwen3Model._normalize_context_k; not patched", MODULE
        )
        return False
    if getattr(stock, _PATCHED, False):
        return True
    from vllm import _custom_ops as ops

    def _normalize_context_k(self, all_k):
        weights = self._k_norm_weights  # [num_layers, head_dim], one row per layer
        if weights.shape[0] == 1:
            return stock(self, all_k)  # the stock path is exact for one layer: keep it bit for bit
        out = all_k.new_empty(all_k.shape)
        for i in range(weights.shape[0]):  # all_k [L, num_ctx, nkv, hd] is contiguous: each slice too
            ops.rms_norm(out[i], all_k[i], weights[i], self._rms_norm_eps)
        return out

    setattr(_normalize_context_k, _PATCHED, True)
    _normalize_context_k.__doc__ = stock.__doc__
    model._normalize_context_k = _normalize_context_k
    log.info("draftflow-vllm-cpu: DFlash context k_norm runs per layer on CPU (%s)", FIX)
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of :data:`MODULE` so the module is patched once run."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        patch(module)

    def __getattr__(self, name):  # get_source, get_data, ...: the real loader's (inspect, resources)
        return getattr(self.loader, name)
