# Sourced by the GPU-call scripts (bench/*.sh): install the carried wheels of the folders given (a bare GPU
# machine has no network: docs/performance.md says which wheels) into /tmp/site, put it and the repository on
# PYTHONPATH, print the GPUs.  A folder without wheels is skipped with a line saying so (a host set up with
# deploy/install.sh has the packages already).  Usage: source bench/device_env.sh .whl .whl-serve || exit 1
_wheels=()
for _d in "$@"; do
  if compgen -G "$_d/*.whl" >/dev/null; then
    _wheels+=("$_d"/*.whl)
  else
    echo "device_env.sh: no wheels in $_d/: using the packages installed on this host" >&2
  fi
done
if [ "${#_wheels[@]}" -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${_wheels[@]}" || { echo "device_env.sh: installing the wheels failed" >&2; return 1; }
fi
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "device_env.sh: nvidia-smi not found" >&2
