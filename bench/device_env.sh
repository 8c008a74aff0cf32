# Sourced by the GPU-call scripts (bench/*.sh): install the carried wheels of the folders given (a bare GPU
# machine has no network: docs/performance.md says which wheels) into /tmp/site, put it and the repository on
# PYTHONPATH, print the GPUs.  Usage: source bench/device_env.sh .whl .whl-serve || exit 1
_wheels=()
for _d in "$@"; do _wheels+=("$_d"/*.whl); done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${_wheels[@]}" || return 1
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
