#!/usr/bin/env bash
# One GPU call for FP8 weights on one GPU (about 9 minutes on an H200):
#   1. the FP8 GEMV tile sweep, saving the best tiles (bench/fp8_gemv_probe.py --save-tiles: they land in
#      qwen_chat/engine/model/fp8_tiles.json, a copy in OUTDIR),
#   2. then, on the tuned tiles, `pytest tests/gpu/test_runner_cuda.py tests/gpu/test_fp8_cuda.py` next to the
#      fp32-reference accuracy run (bench/fp8_accuracy.py); both fit one 141 GB GPU together.
#   bash bench/fp8_gpu_check.sh OUTDIR      # wheels in .whl/ (fla) and .whl-serve/ (see docs/performance.md)
# Writes OUTDIR/{probe,pytest,accuracy}.log, the probe's and the accuracy run's JSON; prints the tails last;
# exits non-zero when any of the three failed.
set -uo pipefail
out="${1:?OUTDIR}"; mkdir -p "$out"
source bench/device_env.sh .whl .whl-serve || exit 1
timeout -k 5 "${PROBE_S:-200}" python3 bench/fp8_gemv_probe.py --save-tiles --out "$out" >"$out/probe.log" 2>&1
probe_rc=$?; echo "probe exit $probe_rc"
cp qwen_chat/engine/model/fp8_tiles.json "$out/" 2>/dev/null
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-pytest timeout -k 5 "${PYTEST_S:-420}" \
    python3 -m pytest -v -p no:cacheprovider -rA tests/gpu/test_runner_cuda.py tests/gpu/test_fp8_cuda.py \
    >"$out/pytest.log" 2>&1 &
pytest_pid=$!
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-acc timeout -k 5 "${ACC_S:-400}" python3 bench/fp8_accuracy.py --out "$out" \
    >"$out/accuracy.log" 2>&1
acc_rc=$?; echo "accuracy exit $acc_rc"
wait "$pytest_pid"; pytest_rc=$?; echo "pytest exit $pytest_rc"
echo "== pytest"; grep -E "PASSED|FAILED|ERROR|passed|failed|error" "$out/pytest.log" | tail -n 40; grep -E "^E " "$out/pytest.log" | head -n 12
echo "== probe"; tail -n 32 "$out/probe.log"
echo "== accuracy"; tail -n 24 "$out/accuracy.log"
[ "$probe_rc" = 0 ] && [ "$pytest_rc" = 0 ] && [ "$acc_rc" = 0 ]
