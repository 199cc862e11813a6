"""Names of serving-side defects that change how a drafter behaves in vLLM.

Kept apart from ``draftflow.vllm`` so the model code (and ``bench/gpu.py``, which runs with the
models alone) can name them without importing the vLLM helpers.
"""

#: vLLM 0.32's CPU build applies layer 0's DFlash k_norm to every layer (fixed by the plugin
#: ``plugins/draftflow_vllm_cpu``, which lists this name in its FIXES).
DFLASH_CPU_K_NORM = "dflash-cpu-grouped-k-norm"
