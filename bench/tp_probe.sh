#!/usr/bin/env bash
# One GPU call on a 2-GPU host: bench/tp_probe.py (single GPU against TP=2, all-reduce kinds, TP GEMV shapes).
#   bash bench/tp_probe.sh OUTDIR      # wheels in .whl/ (fla) and .whl-dist/ (deepspeed ...): docs/performance.md
set -uo pipefail
out="${1:?OUTDIR}"; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl-dist/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 DS_ACCELERATOR=cuda
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ -n "${PRE_TESTS:-}" ]]; then  # e.g. PRE_TESTS="tests/gpu/test_runner_cuda.py -k gdn_kernel"
    timeout -k 5 "${PRE_TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider -rA $PRE_TESTS \
        >"$out/pytest_pre.log" 2>&1; echo "pre-tests exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/pytest_pre.log" | tail -n 12
fi
if [[ "${WITH_TESTS:-1}" == 1 ]]; then  # first: a broken fused kernel would hang the probe's start-up
    timeout -k 5 "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tp_cuda.py \
        >"$out/pytest_tp.log" 2>&1 || { echo "tests failed: fused kernel off"; export QWEN_CHAT_TP_FUSED=0; }
    tail -n 15 "$out/pytest_tp.log"
fi
timeout -k 10 "${PROBE_S:-480}" python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
    bench/tp_probe.py --out "$out" ${PROBE_ARGS:-} 2>&1 | tee "$out/tp_probe.log" | grep -v "^\[rank1\]" | tail -n 80
