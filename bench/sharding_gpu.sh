#!/usr/bin/env bash
# Sharding benchmark on one 2-GPU host (what produced bench/results/*-h200x2-sharding.json):
#   bash bench/sharding_gpu.sh OUTDIR [WHEELS_DIR]
# 1. random bf16 checkpoint of the full Qwen3.5-9B config (bench/sharding_bench.py checkpoint);
# 2. the same scenario (bench/sharding_scenario.json: 2 text prompts + 1 image prompt, 32 greedy tokens each,
#    and a ~4k-token prompt) through bootstrap.start_engine in four modes: one GPU (reference), TP=2 (ds_config.json),
#    ZeRO-3 (deploy/ds_config.zero3.json) and ZeRO-3 + CPU offload (deploy/ds_config.zero3-offload.json);
# 3. one JSON with per-rank memory, load time, TTFT, decode tok/s and greedy agreement (sharding_bench.py collect).
set -uo pipefail
out="${1:?OUTDIR}"; wheels="${2:-}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
# Decode glue runs eager here (no torch.compile warm-up inside the short device window); bench/decode_bench.py
# measures the compiled single-GPU path.
export TORCH_COMPILE_DISABLE=1
if [[ -n "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -n 4
ckpt=/tmp/ckpt9b
proc="${PROCESSOR_DIR:-$wheels/processor}"
[[ -f "$proc/tokenizer.json.gz" && ! -f "$proc/tokenizer.json" ]] && { mkdir -p /tmp/proc && cp "$proc"/* /tmp/proc/ && gunzip -f /tmp/proc/tokenizer.json.gz && proc=/tmp/proc; }
python3 bench/sharding_bench.py checkpoint  --processor "$proc" --out $ckpt 2>&1 | tail -n 3
common=(--model $ckpt --device cuda --max-batch 2 --max-context 8192 --collective-timeout-s 600)
drv=(tests/support/multirank_driver.py --scenario bench/sharding_scenario.json)
run() {  # mode seconds launcher-args...   (own process group: a timeout ends the launcher and its ranks)
    local mode=$1 secs=$2; shift 2
    echo "== $mode $(date +%T)"
    python3 bench/sharding_bench.py run --seconds "$secs" --log "$out/$mode.log" -- "$@"
}
run single "${T_SINGLE:-90}" python3 "${drv[@]}" --out "$out/single.out.json" -- "${common[@]}"
run tp "${T_TP:-100}" deepspeed --num_gpus 2 --master_port 29701 "${drv[@]}" --out "$out/tp.out.json" -- "${common[@]}" --ds-config ds_config.json
# The two ZeRO-3 modes run at the same time on the same 2 GPUs (device time is scarce): their memory numbers
# are per process and unaffected, their speeds are measured under each other's load.
run zero3 "${T_Z3:-160}" deepspeed --num_gpus 2 --master_port 29702 "${drv[@]}" --only "${ONLY_Z3:-text_rocket,image_cat,text_4k}" --out "$out/zero3.out.json" -- "${common[@]}" --ds-config deploy/ds_config.zero3.json &
run zero3-offload "${T_OFF:-160}" deepspeed --num_gpus 2 --master_port 29703 "${drv[@]}" --only "${ONLY_OFF:-text_rocket,text_4k}" --out "$out/zero3-offload.out.json" -- "${common[@]}" --ds-config deploy/ds_config.zero3-offload.json &
wait
python3 bench/sharding_bench.py collect --logs "$out" --out "$out/$(date +%F)-h200x2-sharding.json" --command "bash bench/sharding_gpu.sh OUT .whl-dist"
rm -f "$out"/*.out.json "$out"/*.partial.json
