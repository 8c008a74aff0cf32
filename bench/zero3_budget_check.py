"""Does the service start under ZeRO-3 + CPU offload on a small GPU budget with the default flags, and answer?

Usage (GPU host, repository root; the checkpoint is the one ``bench/serve_bench.py`` builds)::

    python bench/zero3_budget_check.py --model CKPT [--gib 6] [--out FILE.json]

Starts ``QWEN_CHAT_DS_CONFIG=deploy/ds_config.zero3-offload.json bash start.sh --model CKPT`` with the CUDA
allocator capped at ``--gib`` GiB (``serve_proc.cap_sitecustomize``), waits for ``/healthz`` 200, streams one
chat completion (64 tokens) and writes: started, start-up seconds, the start-up error line, the memory-budget
line of the log, TTFT (ms) and decode tok/s of that one reply.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_http as H  # noqa: E402
from serve_proc import FRACTION_ENV, Service, cap_sitecustomize, free_port  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gib", type=float, default=6.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout-s", type=float, default=240.0)
    args = ap.parse_args(argv)
    total = torch.cuda.get_device_properties(0).total_memory
    folder = Path(tempfile.mkdtemp(prefix="zero3cap-"))
    cap_sitecustomize(folder)
    env = {FRACTION_ENV: f"{args.gib * 2**30 / total:.6f}",
           "PYTHONPATH": f"{folder}:{os.environ.get('PYTHONPATH', '')}",
           "QWEN_CHAT_DS_CONFIG": "deploy/ds_config.zero3-offload.json", "CUDA_VISIBLE_DEVICES": "0"}
    port = free_port()
    log = Path(args.out or "/tmp/zero3.json").with_suffix(".log")
    svc = Service(["--model", args.model, "--port", str(port)], port, log, env=env)
    result = {"command": f"QWEN_CHAT_DS_CONFIG=deploy/ds_config.zero3-offload.json bash start.sh --model CKPT "
                         f"(allocator capped at {args.gib} GiB)", "date": time.strftime("%Y-%m-%d")}
    try:
        result["started"] = svc.start(args.timeout_s)
        result["startup_s"] = svc.startup_s
        result["error"] = svc.error
        text = svc.log_text()
        result["memory_line"] = next((ln for ln in text.splitlines() if "memory budget" in ln), None)
        if result["started"]:
            import random
            run = H.one(svc.base_url, H.random_prompt(200, random.Random(1)), 64)
            result["reply"] = H.result_dict(run)
    finally:
        svc.stop()
    print(json.dumps(result, indent=1, default=str)[:3000])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0 if result.get("started") else 1


if __name__ == "__main__":
    sys.exit(main())
