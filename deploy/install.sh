#!/usr/bin/env bash
# Install the Qwen3.5 chat service's Python dependencies (and, with --test, what the tests need).
#
#   bash deploy/install.sh          # runtime: pip install -r requirements.txt, then deepspeed; on a CUDA host
#                                   # also fla-core + flash-linear-attention 0.6.0 (the fast prefill kernels)
#   bash deploy/install.sh --test   # also Debian's chromium + chromium-driver for the browser test, and
#                                   # checks the pinned Triton the kernel tests run under its interpreter
#
# Every pip install applies the lock file constraints.txt (exact versions of every package, transitive ones
# included), and triton is pinned to match the torch build (see below), so a fresh install cannot drift.
# Uses the current `python3` ($PYTHON overrides it; activate a virtual environment first if you want one), the
# interpreter start.sh runs.  Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

with_test=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $arg (expected --test)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}

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

# Every install goes through the lock file.
pip_install() { "$PY" -m pip install -c constraints.txt "$@"; }

# torch first, pinned: on a machine without CUDA this resolves to the CPU wheel.
torch_pin=$(grep -E '^torch==' requirements.txt)
pip_install "$torch_pin"

# Triton matched to the torch build that was just installed.  A CUDA build of torch requires its own exact
# triton (`triton==3.x.y; platform_system == "Linux" ...` in its metadata): that is the pin.  The CPU build
# requires none, but xgrammar pulls an unpinned triton on Linux x86_64, and the Triton interpreter tests
# (tests/engine/test_triton_kernels.py) pass with triton==3.6.0 under the CPU torch: that is the pin then.
# It is not in constraints.txt because it depends on the torch build; instead it is named on the command line
# of every install below (idempotent when that version is already there), so no dependency resolves another.
triton_pin=$("$PY" - <<'PYEOF'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
pin = "triton==3.6.0"
for line in md.requires("torch") or []:
    req = Requirement(line)
    if req.name.lower() == "triton" and (req.marker is None or req.marker.evaluate({"extra": ""})):
        pin = f"triton{req.specifier}"
        break
print(pin)
PYEOF
)
echo "install.sh: Triton for this torch build: $triton_pin"

pip_install -r requirements.txt "$triton_pin"
# deepspeed needs torch at build time; DS_BUILD_OPS=0 builds no CUDA ops now (they JIT-compile if ever used).
DS_BUILD_OPS=0 pip_install --no-build-isolation deepspeed==0.19.8 "$triton_pin"
# CUDA host (a GPU that nvidia-smi lists, or a torch that sees one): the Gated DeltaNet prefill kernels of
# flash-linear-attention, pinned (transformers uses them when importable; without them it logs a fall-back to
# its PyTorch implementation: same results, long prompts slower).  CPU hosts skip them.
if nvidia-smi -L >/dev/null 2>&1 || "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "install.sh: CUDA host: installing the fast prefill kernels fla-core==0.6.0 and flash-linear-attention==0.6.0"
  pip_install fla-core==0.6.0 flash-linear-attention==0.6.0 "$triton_pin"
else
  echo "install.sh: no CUDA GPU found: skipping fla-core / flash-linear-attention (PyTorch fall-back kernels)"
fi
if [ "$with_test" = 1 ]; then
  # The kernel tests run under this Triton: make sure it is the pinned one (also when another Triton was
  # importable before this script ran; the installs above replaced it).
  "$PY" - "$triton_pin" <<'PYEOF'
import sys, importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
want = Requirement(sys.argv[1])
have = md.version("triton")
if not want.specifier.contains(have, prereleases=True):
    sys.exit(f"install.sh: triton {have} is installed, expected {want}")
PYEOF
fi
echo "install.sh: done"
