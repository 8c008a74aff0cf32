#!/usr/bin/env bash
# GPU calls for speculative decoding on one GPU, in parts that each fit a 10-minute call:
#   tests  the CUDA tests of the verify step (tests/gpu/test_speculative_cuda.py: graph-captured verify leaves the
#          state of plain decoding, greedy replies equal plain decoding; about a minute)
#   bf16   the oracle-draft benchmark (bench/spec_bench.py) in bf16
#   fp8    the same with --quantize fp8
#   bash bench/spec_gpu.sh OUTDIR tests bf16      # then: bash bench/spec_gpu.sh OUTDIR fp8
# (wheels in .whl/ and .whl-serve/, see docs/performance.md).  The benchmark's random full-config checkpoint is
# built on first use (bench/serve_ckpt.py, ~19 GB written: minutes on a fresh machine) and reused from
# ~/.cache/qwen_chat/serve_bench afterwards, e.g. after bench/serve_bench.py on the same machine.
# Writes OUTDIR/{pytest,bench-bf16,bench-fp8}.log and OUTDIR/<date>-NVIDIA-H200-speculative[-fp8].json; prints
# the tails; exits non-zero when a part failed.
set -uo pipefail
out="${1:?OUTDIR}"; shift; mkdir -p "$out"
source bench/device_env.sh .whl .whl-serve || exit 1
rc=0
parts=("$@"); [ "${#parts[@]}" -eq 0 ] && parts=(tests bf16)
for part in "${parts[@]}"; do
  case "$part" in
    tests) timeout -k 5 "${PYTEST_S:-240}" python3 -m pytest -v -p no:cacheprovider -rA \
               tests/gpu/test_speculative_cuda.py >"$out/pytest.log" 2>&1 || rc=1
           grep -E "PASSED|FAILED|ERROR|passed|failed|error" "$out/pytest.log" | tail -n 20
           grep -E "^E " "$out/pytest.log" | head -n 12 ;;
    bf16|fp8) flag=(); suffix=""
           [ "$part" = fp8 ] && { flag=(--quantize fp8); suffix="-fp8"; }
           timeout -k 5 "${BENCH_S:-540}" python3 bench/spec_bench.py "${flag[@]}" \
               --out "$out/$(date +%F)-NVIDIA-H200-speculative$suffix" >"$out/bench-$part.log" 2>&1 || rc=1
           echo "== bench $part"; grep -v '^ ' "$out/bench-$part.log" | tail -n 24 ;;
    *) echo "unknown part $part (tests, bf16, fp8)"; rc=1 ;;
  esac
done
exit $rc
