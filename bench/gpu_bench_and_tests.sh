#!/usr/bin/env bash
# One GPU call on a 2-GPU host: the decode benchmark on GPU 0 next to `pytest tests/gpu` on GPU 1.
#   bash bench/gpu_bench_and_tests.sh OUTDIR     # wheels in .whl/ (fla) and .whl-dist/ (see docs/performance.md)
# Writes OUTDIR/bench.log, OUTDIR/pytest.log and OUTDIR/res/<date>-<gpu>-single.{json,png}; prints both tails.
set -uo pipefail
out="${1:?OUTDIR}"; mkdir -p "$out"
source bench/device_env.sh .whl .whl-dist || exit 1
CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind-pytest timeout -k 5 "${PYTEST_S:-500}" \
    python3 -m pytest -q -p no:cacheprovider -rA tests/gpu >"$out/pytest.log" 2>&1 &
CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ind-bench timeout -k 5 "${BENCH_S:-540}" \
    python3 bench/decode_bench.py --skip-eager-glue --out "$out/res" ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
echo "bench exit $?"
wait
echo "== pytest tests/gpu"; grep -E "PASSED|FAILED|ERROR|passed|failed|error" "$out/pytest.log" | tail -n 12
echo "== bench"; tail -n 48 "$out/bench.log"
