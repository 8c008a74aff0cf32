#!/usr/bin/env bash
# One-call GPU verification on a 2-GPU host (what produced bench/results/*-h200x2-verify.json):
#   bash bench/gpu_verify.sh OUTDIR            # GPU host; wheels in .whl/ (fla) and .whl-dist/ (deepspeed, tokenizer)
#   bash bench/gpu_verify.sh OUTDIR --smoke    # CPU, tiny model, 2 gloo ranks: checks the script only
# Steps, each time-boxed inside one overall budget (BUDGET_S, default 430 s):
# 1. random bf16 checkpoint of the full Qwen3.5-9B config on GPU 0 (sharding_bench.py checkpoint), and at the
#    same time `pytest -q tests/gpu` on GPU 1 (the runner's CUDA-graph tests; PYTEST_S, default 100 s: too short
#    on 2026-11-30, where fla's Triton kernels and the compiled glue were built cold next to the single-GPU run's
#    compile and only the first of 4 tests finished: give it ~240 s);
# 2. bench/sharding_scenario.json through bootstrap.start_engine on one GPU ("single"), then TP=2 (ds_config.json),
#    both as the service runs on a GPU: fla kernels installed, decode glue compiled, decode graphs captured at
#    start-up (build_runner).  Each mode gets its own cold Inductor cache (a fresh service start).  A mode that
#    does not finish is re-run with TORCH_COMPILE_DISABLE=1 ("<mode>_eager") if time is left;
# 3. bench/gpu_verify.py collect: one JSON + the summary table (printed last).
set -uo pipefail
out="${1:?OUTDIR}"; smoke=0; [[ "${2:-}" == "--smoke" ]] && smoke=1
mkdir -p "$out"; out="$(cd "$out" && pwd)"
T0=$(date +%s); BUDGET=${BUDGET_S:-430}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
box() {  # box WANT RESERVE: WANT seconds, or less so that RESERVE seconds of the budget stay
    local want=$1 l; l=$(( $(left) - $2 )); (( l < want )) && want=$l; (( want < 5 )) && want=5; echo "$want"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TORCH_COMPILE_DISABLE
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if (( smoke )); then
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
    gpu0=(); gpu1=()
    ckpt="$out/cache"; dev=cpu; ctx=512
else
    export DS_ACCELERATOR=cuda
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl .whl-dist/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH
    gpu0=(env CUDA_VISIBLE_DEVICES=0); gpu1=(env CUDA_VISIBLE_DEVICES=1)
    ckpt=/tmp/ckpt9b; dev=cuda; ctx=8192
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m | head -n 3
fi
python3 - "$out/env.json" <<'EOF'
import importlib, json, platform, sys
env = {"python": platform.python_version()}
for name in ("torch", "transformers", "deepspeed", "fla", "triton"):
    try:
        m = importlib.import_module(name); env[name] = getattr(m, "__version__", "?")
    except Exception as exc:
        env[name] = f"not importable: {type(exc).__name__}: {str(exc)[:200]}"
try:
    import torch
    env["cuda"] = torch.version.cuda
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception:
    pass
print(json.dumps(env)); json.dump(env, open(sys.argv[1], "w"))
EOF

echo "== $(date +%T) checkpoint + pytest tests/gpu (left $(left) s)"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-pytest "${gpu1[@]}" timeout -k 5 "$(box "${PYTEST_S:-100}" 300)" \
    python3 -m pytest -q -p no:cacheprovider tests/gpu >"$out/pytest.log" 2>&1 &
pytest_pid=$!
if (( smoke )); then
    python3 -m qwen_chat.engine.checkpoints.tiny "$ckpt" 2>&1 | tail -n 2
    model=(--model tiny --cache-dir "$ckpt")
else
    proc=.whl-dist/processor
    [[ -f "$proc/tokenizer.json.gz" && ! -f "$proc/tokenizer.json" ]] && { mkdir -p /tmp/proc && cp "$proc"/* /tmp/proc/ && gunzip -f /tmp/proc/tokenizer.json.gz && proc=/tmp/proc; }
    "${gpu0[@]}" timeout -k 5 "$(box 120 280)" python3 bench/sharding_bench.py checkpoint --processor "$proc" --out $ckpt 2>&1 | tail -n 3
    model=(--model $ckpt)
fi
common=("${model[@]}" --device $dev --max-batch 2 --max-context $ctx --collective-timeout-s 600)
drv=(tests/support/multirank_driver.py --scenario bench/sharding_scenario.json)
[[ $smoke == 1 ]] && drv+=(--only text_rocket,text_haiku,image_cat)

run_mode() {  # run_mode MODE SECONDS launcher-args...
    local mode=$1 secs=$2; shift 2
    echo "== $(date +%T) $mode (box $secs s, left $(left) s)"
    python3 bench/sharding_bench.py run --seconds "$secs" --log "$out/$mode.log" -- "$@"  # log starts "# launch <epoch>"
    [[ -f "$out/$mode.out.json" ]] && rm -f "$out/$mode.out.partial.json"
    grep -E "captured|self-check passed|runner implementation|rank [0-9]/[0-9]: device|Error" "$out/$mode.log" | cut -c1-300 | tail -n 12
}
single() {  # single MODE SECONDS
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$1 run_mode "$1" "$2" "${gpu0[@]}" python3 "${drv[@]}" --out "$out/$1.out.json" -- "${common[@]}"; }
tp() {
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$1 run_mode "$1" "$2" python3 -m deepspeed.launcher.runner --num_gpus 2 --master_port 29711 \
        "${drv[@]}" --out "$out/$1.out.json" -- "${common[@]}" --ds-config ds_config.json; }

# single GPU on GPU 0 (pytest may still be running on GPU 1), then TP=2 once pytest is done
single single "$(box "${SINGLE_S:-170}" 210)"
wait $pytest_pid; echo "pytest tests/gpu: rc=$?" >>"$out/pytest.log"; tail -n 3 "$out/pytest.log"
tp tp "$(box "${TP_S:-210}" 25)"
# fall-backs: glue not compiled, only if time is left
if [[ ! -f "$out/tp.out.json" ]] && (( $(left) > 110 )); then TORCH_COMPILE_DISABLE=1 tp tp_eager "$(box 150 25)"; fi
if [[ ! -f "$out/single.out.json" ]] && (( $(left) > 90 )); then TORCH_COMPILE_DISABLE=1 single single_eager "$(box 120 20)"; fi

res="$out/$(date +%F)-h200x2-verify.json"; (( smoke )) && res="$out/smoke-verify.json"
python3 bench/gpu_verify.py collect --dir "$out" --out "$res" --command "bash bench/gpu_verify.sh OUT"
# at most 8 files come back from the device tool: the raw driver outputs and env.json go into one archive
(cd "$out" && tar czf raw.tar.gz ./*.out*.json env.json && rm -f ./*.out*.json env.json)
echo "== $(date +%T) done in $(( $(date +%s) - T0 )) s"
