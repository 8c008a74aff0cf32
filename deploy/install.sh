#!/usr/bin/env bash
# Install the Qwen3.5 chat service's Python dependencies (and, with --test, what the tests need).
#
#   bash deploy/install.sh          # runtime: pip install -r requirements.txt, then deepspeed; on a CUDA host
#                                   # also fla-core + flash-linear-attention 0.6.0 (the fast prefill kernels)
#   bash deploy/install.sh --test   # also Debian's chromium + chromium-driver for the browser test, and
#                                   # Triton (CPU hosts) for the kernel tests under its interpreter
#
# Uses the current `python` (activate a virtual environment first if you want one).  Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

with_test=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $arg (expected --test)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python}

if [ "$with_test" = 1 ]; then
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
  if [ "${#missing[@]}" -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    echo "install.sh: installing ${missing[*]} from Debian"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
  fi
fi

# torch first, pinned: on a machine without CUDA this resolves to the CPU wheel.
torch_pin=$(grep -E '^torch==' requirements.txt)
"$PY" -m pip install "$torch_pin"
"$PY" -m pip install -r requirements.txt
# deepspeed needs torch at build time; DS_BUILD_OPS=0 builds no CUDA ops now (they JIT-compile if ever used).
DS_BUILD_OPS=0 "$PY" -m pip install --no-build-isolation deepspeed==0.19.8
# CUDA host (a GPU that nvidia-smi lists, or a torch that sees one): the Gated DeltaNet prefill kernels of
# flash-linear-attention, pinned (transformers uses them when importable; without them it logs a fall-back to
# its PyTorch implementation: same results, long prompts slower).  CPU hosts skip them.
if nvidia-smi -L >/dev/null 2>&1 || "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "install.sh: CUDA host: installing the fast prefill kernels fla-core==0.6.0 and flash-linear-attention==0.6.0"
  "$PY" -m pip install fla-core==0.6.0 flash-linear-attention==0.6.0
else
  echo "install.sh: no CUDA GPU found: skipping fla-core / flash-linear-attention (PyTorch fall-back kernels)"
fi
if [ "$with_test" = 1 ] && ! "$PY" -c "import triton" >/dev/null 2>&1; then
  # CPU hosts: Triton's interpreter runs the decode kernels in tests/engine/test_triton_kernels.py (CUDA builds of
  # torch bring their own Triton, which is left alone).
  "$PY" -m pip install triton==3.6.0
fi
echo "install.sh: done"
