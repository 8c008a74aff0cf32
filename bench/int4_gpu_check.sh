#!/usr/bin/env bash
# One GPU call for 4-bit weights on one GPU (about 5-8 minutes on an H200):
#   1. bench/int4_gemv_probe.py --save-tiles: the W4A16 GEMV checked on CUDA against the dequantised matmul and
#      timed against the bf16 and FP8 paths per decode shape and batch, with a tile sweep whose best tiles land in
#      qwen_chat/engine/model/int4_tiles.json (a copy in OUTDIR; PROBE_ARGS=--quick skips the sweep),
#   2. then `pytest tests/gpu/test_int4_cuda.py` (kernels on CUDA, graph-captured decode with --quantize int4
#      against transformers).
#   bash bench/int4_gpu_check.sh OUTDIR      # wheels in .whl/ and .whl-serve/ when the host lacks packages
# Writes OUTDIR/{probe,pytest}.log, the probe's JSON and int4_tiles.json; prints the tails last; exits non-zero when one failed.
set -uo pipefail
out="${1:?OUTDIR}"; mkdir -p "$out"
source bench/device_env.sh .whl .whl-serve || exit 1
timeout -k 5 "${PROBE_S:-420}" python3 bench/int4_gemv_probe.py --save-tiles ${PROBE_ARGS:-} --out "$out" \
    >"$out/probe.log" 2>&1
probe_rc=$?; echo "probe exit $probe_rc"
cp qwen_chat/engine/model/int4_tiles.json "$out/" 2>/dev/null
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-int4 timeout -k 5 "${PYTEST_S:-200}" \
    python3 -m pytest -v -p no:cacheprovider -rA tests/gpu/test_int4_cuda.py >"$out/pytest.log" 2>&1
pytest_rc=$?; echo "pytest exit $pytest_rc"
echo "== pytest"; grep -E "PASSED|FAILED|ERROR|passed|failed|error" "$out/pytest.log" | tail -n 20; grep -E "^E " "$out/pytest.log" | head -n 12
echo "== probe"; tail -n 32 "$out/probe.log"
[ "$probe_rc" = 0 ] && [ "$pytest_rc" = 0 ]
