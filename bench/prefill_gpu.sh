#!/usr/bin/env bash
# GPU call for the prefill graphs on one GPU (fits one 10-minute call):
#   tests  the runner's CUDA tests (tests/gpu/test_runner_cuda.py: prefill graphs against the same pieces run
#          eagerly, exactly in fp32, and against the packed prefill and the reference; decode graphs; ~3 minutes)
#   bench  bench/prefill_bench.py on the full config (graph against eager prefill, follow-up turn, kernels,
#          agreement with an fp32 copy of the model; ~3 minutes)
#   bash bench/prefill_gpu.sh OUTDIR tests bench
# (wheels in .whl-serve/, see bench/serve_gpu.sh).  Writes OUTDIR/pytest.log, OUTDIR/bench.log and
# OUTDIR/<date>-NVIDIA-H200-prefill.json; prints the tails; exits non-zero when a part failed.
set -uo pipefail
out="${1:?OUTDIR}"; shift; mkdir -p "$out"
source bench/device_env.sh .whl-serve || exit 1
rc=0
parts=("$@"); [ "${#parts[@]}" -eq 0 ] && parts=(tests bench)
for part in "${parts[@]}"; do
  case "$part" in
    tests) timeout -k 5 "${PYTEST_S:-300}" python3 -m pytest -q -p no:cacheprovider -rA \
               tests/gpu/test_runner_cuda.py >"$out/pytest.log" 2>&1 || rc=1
           grep -E "PASSED|FAILED|ERROR|passed|failed|error" "$out/pytest.log" | tail -n 40
           grep -E "^E " "$out/pytest.log" | head -n 20 ;;
    bench) timeout -k 5 "${BENCH_S:-300}" python3 bench/prefill_bench.py \
               --out "$out/$(date +%F)-NVIDIA-H200-prefill" >"$out/bench.log" 2>&1 || rc=1
           echo "== bench"; grep -v '^ ' "$out/bench.log" | grep -v USDT | tail -n 30 ;;
    *) echo "unknown part $part (tests, bench)"; rc=1 ;;
  esac
done
exit $rc
