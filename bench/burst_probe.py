"""Prefill steps of a burst, as the scheduler cuts them, timed one by one (engine only, no HTTP; for kernel work):
N prompts of ~600 random tokens arrive at once and each step packs up to 4,096 prompt tokens (a prompt cut at
the budget continues in the next step).  Bursts of 32, 64 and again 32 prompts (one prompt of each burst is one
token longer, as a real burst's lengths differ), so a step that costs far more than its neighbours (a kernel
compiled or autotuned for a new shape, a host stall) shows, and whether it comes back on the second 32-burst.

    python bench/burst_probe.py --out bench/results/<date>-<gpu>-burst-probe      # writes <out>.json, prints a table
    python bench/burst_probe.py --smoke --out /tmp/b                              # tiny config on CPU
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_bench import random_model, random_ids  # noqa: E402
from prefill_bench import burst_steps  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt  # noqa: E402


def run_burst(runner, dev, n: int, length: int, budget: int, gen) -> list[dict]:
    prompts = [PreparedPrompt(input_ids=random_ids(length + (i == n // 2), gen)) for i in range(n)]
    out = []
    for step in burst_steps(prompts, budget):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        runner.prefill_batch(step)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out.append({"tokens": sum(c.stop() - c.start for c in step), "chunks": len(step),
                    "continuing": sum(c.start > 0 for c in step), "ms": (time.perf_counter() - t0) * 1e3})
    for slot in range(n):
        runner.free(slot)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json is added)")
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (checks the script)")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    model = random_model(dev, args.smoke)
    gen = torch.Generator().manual_seed(0)
    length, budget = (600, 4096) if not args.smoke else (30, 80)
    runner = ModelRunner(model, num_slots=64, max_context=1024 if not args.smoke else 64, device=dev)
    if dev.type == "cuda":  # as the service: the single-chunk steps go through the prefill graphs
        runner.capture_prefill()
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "impl": runner.impl, "bursts": []}
    for n in (32, 64, 32):
        doc["bursts"].append({"prompts": n, "steps": run_burst(runner, dev, n, length, budget, gen)})
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
    print(f"\n## prefill steps of bursts, {doc['device']}, torch {doc['torch']}, {doc['date']}")
    for b in doc["bursts"]:
        print(f"{b['prompts']} prompts: " + ", ".join(f"{s['tokens']}t/{s['chunks']}c {s['ms']:.0f} ms"
                                                      for s in b["steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
