"""Prefill steps as the scheduler cuts them, timed one by one on a runner prepared as the service prepares it
(prefill graphs captured, the start-up warm-up run), with the Triton kernels each step compiled (engine only, no
HTTP; for kernel work).  Each step takes up to 4,096 prompt tokens (a prompt cut at the budget continues in the
next step).  Cases, each run twice in a row: single prompts of 1k, 8k and 32k random tokens, then bursts of 32,
64 and 128 prompts of ~600 tokens (one prompt of each burst is one token longer, as a real burst's lengths
differ) and the 32-prompt burst again.  A step that costs far more than its neighbours, and the kernels it
compiled, show what a request meets the first time after ready (a first-use stall).

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
from qwen_chat.engine.model.fla_tuning import use_measured_configs  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner  # noqa: E402
from qwen_chat.engine.startup import compile_stats  # noqa: E402
from qwen_chat.engine.startup.warmup import warm_up_prefill  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt  # noqa: E402


def run_steps(runner, dev, prompts: list, budget: int) -> list[dict]:
    """Prefill ``prompts`` (slots 0..) step by step as the scheduler cuts them (``burst_steps``); per step its
    tokens, chunks, continuing chunks, milliseconds and the Triton kernels compiled meanwhile (name: count)."""
    tally = compile_stats.shared()
    out = []
    for step in burst_steps(prompts, budget):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        mark = tally.mark()
        t0 = time.perf_counter()
        runner.prefill_batch(step)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t0) * 1e3
        compiled = tally.compiled_since(mark)
        out.append({"tokens": sum(c.stop() - c.start for c in step), "chunks": len(step),
                    "continuing": sum(c.start > 0 for c in step), "ms": ms, "compiled": compiled})
    for slot in range(len(prompts)):
        runner.free(slot)
    return out


def cases(smoke: bool) -> list[tuple[str, list[int]]]:
    """(name, prompt lengths) of each case, in the order they run."""
    if smoke:
        return [("1 x 40", [40]), ("burst 4 x 30", [30, 30, 31, 30])]
    burst = lambda n: [600 + (i == n // 2) for i in range(n)]  # noqa: E731
    return [("1 x 1k", [1000]), ("1 x 8k", [8010]), ("1 x 32k", [32000]), ("burst 32", burst(32)),
            ("burst 64", burst(64)), ("burst 128", burst(128)), ("burst 32 again", burst(32))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json is added)")
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (checks the script)")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    model = random_model(dev, args.smoke)
    gen = torch.Generator().manual_seed(0)
    budget = 4096 if not args.smoke else 80
    max_context = 33000 if not args.smoke else 64
    runner = ModelRunner(model, num_slots=128 if not args.smoke else 8, max_context=max_context,
                         num_blocks=(128 * 640 + 2 * max_context) // 64 if not args.smoke else None, device=dev)
    tally = compile_stats.shared()
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "impl": runner.impl, "setup": {}, "cases": []}
    doc["setup"]["fla"] = use_measured_configs(dev)  # as the service (build_runner)
    if dev.type == "cuda":  # as the service: the prefill graphs, then the start-up warm-up (no photo: no processor)
        mark = tally.mark()
        runner.capture_prefill()
        doc["setup"]["prefill graphs"] = tally.describe(mark)
        mark = tally.mark()
        warm_up_prefill(runner, None, budget, 0)
        doc["setup"]["warm-up"] = tally.describe(mark)
    for name, lengths in cases(args.smoke):
        for attempt in ("first", "second"):
            prompts = [PreparedPrompt(input_ids=random_ids(n, gen)) for n in lengths]
            doc["cases"].append({"case": name, "attempt": attempt, "steps": run_steps(runner, dev, prompts, budget)})
            Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
    print(f"\n## prefill steps, {doc['device']}, torch {doc['torch']}, {doc['date']}")
    for k, v in doc["setup"].items():
        print(f"{k}: {v}")
    for c in doc["cases"]:
        slow = [s for s in c["steps"] if s["compiled"]]
        print(f"{c['case']} ({c['attempt']}): {sum(s['ms'] for s in c['steps']):.0f} ms in {len(c['steps'])} steps, "
              "steps " + ", ".join(f"{s['ms']:.0f}" for s in c["steps"])
              + "".join(f"\n    {s['tokens']}t/{s['chunks']}c {s['ms']:.0f} ms compiled {s['compiled']}" for s in slow))
    return 0


if __name__ == "__main__":
    sys.exit(main())
