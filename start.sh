#!/usr/bin/env bash
# Start the chat service on every local GPU (what Supervisor runs): one GPU as one process, several through the
# DeepSpeed launcher.
#
#   bash start.sh --model Qwen/Qwen3.5-9B --host 0.0.0.0 ...     # all visible GPUs, ds_config.json (TP)
#   NUM_GPUS=2 bash start.sh ...                                  # the first 2 visible GPUs
#   QWEN_CHAT_DS_CONFIG=deploy/ds_config.zero3-offload.json bash start.sh ...   # ZeRO-3 + CPU offload
#   HOSTFILE=/etc/deepspeed/hostfile bash start.sh ...            # several machines (docs/sharding.md)
#   NUM_CPU_RANKS=2 bash start.sh --model tiny                    # no GPU: 2 CPU ranks over gloo
#   DATA_PARALLEL=2 bash start.sh ...                             # 2 replicas of the model (docs/replicas.md)
#
# Every argument is passed to app.py (the launcher adds --local_rank=N, which app.py accepts).  Only rank 0
# binds the web port; the other ranks serve rank 0's engine steps.  Environment:
#   NUM_GPUS             ranks on this machine (default: every visible GPU; CUDA_VISIBLE_DEVICES applies)
#   NUM_CPU_RANKS        without GPUs: run this many CPU ranks (gloo) instead of one plain process
#   QWEN_CHAT_DS_CONFIG  DeepSpeed config (default ds_config.json: tensor parallel over all ranks); --ds-config wins
#   MASTER_PORT          rendezvous port of the launcher (default 29500)
#   HOSTFILE             DeepSpeed hostfile for multi-node runs (passwordless ssh between the machines)
#   DATA_PARALLEL        replicas the ranks form (read by app.py, like --data-parallel; default 1)
#   QWEN_CHAT_COMPILE_CACHE  where compiled kernels are kept between starts (default ~/.cache/qwen_chat/compile)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
export QWEN_CHAT_DS_CONFIG="${QWEN_CHAT_DS_CONFIG:-$here/ds_config.json}"
export PYTHONUNBUFFERED=1
# Compiled kernels survive restarts (docs/deployment.md, "Start-up time"): Inductor's cache (the decode glue
# and sampler), Triton's (every Triton kernel, fla's included) and Triton's autotuning results (fla's kernels
# are autotuned on first use: seconds per kernel otherwise on every start).  Each cache keys its entries by
# the source, the library versions and the GPU, so a changed version recompiles.  Set variables win.
compile_cache="${QWEN_CHAT_COMPILE_CACHE:-${HOME:-/tmp}/.cache/qwen_chat/compile}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$compile_cache/inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$compile_cache/triton}"
export TRITON_CACHE_AUTOTUNING="${TRITON_CACHE_AUTOTUNING:-1}"
port="${MASTER_PORT:-29500}"
py="${PYTHON:-python3}"

if [[ -n "${HOSTFILE:-}" ]]; then
    exec deepspeed --hostfile "$HOSTFILE" --master_port "$port" app.py "$@"
fi

# Count GPUs without importing torch (seconds saved on every start: a failing start-up must fail well inside
# Supervisor's startsecs).  CUDA_VISIBLE_DEVICES narrows the set as CUDA itself would.
count_gpus() {
    command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
    local found
    found="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
        local v="${CUDA_VISIBLE_DEVICES// /}"
        if [[ -z "$v" || "$v" == -* ]]; then echo 0; return; fi
        local ids
        IFS=',' read -ra ids <<< "$v"
        (( ${#ids[@]} < found )) && found=${#ids[@]}
    fi
    echo "${found:-0}"
}
gpus="$(count_gpus)"
if [[ "$gpus" -gt 0 ]]; then
    n="${NUM_GPUS:-$gpus}"
    if [[ "$n" -eq 1 ]]; then
        # One GPU needs no launcher (one process, the first visible GPU): starting DeepSpeed's runner and
        # launch.py costs several seconds of imports on every start (docs/deployment.md, "Start-up time").
        exec "$py" app.py "$@"
    fi
    exec deepspeed --num_gpus "$n" --master_port "$port" app.py "$@"
fi

if [[ -n "${NUM_CPU_RANKS:-}" && "${NUM_CPU_RANKS}" -gt 1 ]]; then
    # DeepSpeed's CPU accelerator: gloo process groups, one process per rank on this machine.
    export DS_ACCELERATOR=cpu
    exec deepspeed --num_gpus "$NUM_CPU_RANKS" --master_port "$port" app.py --device cpu "$@"
fi
exec "$py" app.py --device cpu "$@"
