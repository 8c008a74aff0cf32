"""Inductor's runtime autotuning of the decode glue: what it costs a cold start and what it buys a decode step.

A cold start spent 26 s in ``CachingAutotuner.benchmark_all_configs`` (25 kernels, TorchDynamo's timers in the
start-up log, one H200, 2026-12-04): Inductor benchmarks several tile configurations of each pointwise and
reduction kernel of the compiled glue at its first run.  ``torch._inductor.config.triton.autotune_pointwise =
False`` makes it take its heuristic's one configuration instead.  This probe runs both ways, each in a fresh
process with empty Inductor and Triton caches (a first start on a new machine): the random full-config model,
128 slots holding 64-token prompts, decode graphs captured for 1, 2, 32 and 128 rows (the compiling and
autotuning happen there), then the decode step's milliseconds at 1, 32 and 128 rows (median of 50 replays).

    python bench/glue_autotune_probe.py --out bench/results/<date>-<gpu>-glue-autotune   # .json, table last
    python bench/glue_autotune_probe.py --smoke --out /tmp/g                             # tiny config on CPU
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("autotuned", "one-config")
ROWS = (1, 32, 128)


def child(mode: str, smoke: bool) -> dict:
    """One mode in this process (caches already pointed at empty folders by the parent)."""
    import torch

    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    from decode_bench import random_model
    from qwen_chat.engine.model.runner import ModelRunner
    from qwen_chat.engine.startup import compile_stats
    from qwen_chat.engine.types import PreparedPrompt

    torch._inductor.config.triton.autotune_pointwise = mode == "autotuned"
    dev = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    slots = 8 if smoke else 128
    model = random_model(dev, smoke)
    runner = ModelRunner(model, num_slots=slots, max_context=512, num_blocks=slots * 8 + 16, device=dev)
    gen = torch.Generator().manual_seed(0)
    for s in range(slots):
        runner.prefill(s, PreparedPrompt(input_ids=torch.randint(10, 1000, (1, 64), generator=gen)))
    tally = compile_stats.shared()
    mark = tally.mark()
    t0 = time.perf_counter()
    held = runner.capture_all(batch_sizes=[b for b in (1, 2, 32, 128) if b <= slots],
                              context_buckets=[runner.context_bucket(400)])
    capture_s = time.perf_counter() - t0
    out = {"mode": mode, "graphs": held, "capture_s": round(capture_s, 1), "compiled": tally.describe(mark),
           "torch_compile_steps": compile_stats.torch_compile_steps(12), "step_ms": {}}
    for rows in ROWS:
        rows = min(rows, slots)
        batch = list(range(rows))
        tokens = torch.full((rows,), 11, dtype=torch.long)
        times = []
        for i in range(55):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            runner.decode(batch, tokens)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= 5:
                times.append((time.perf_counter() - t) * 1e3)
        out["step_ms"][str(rows)] = round(statistics.median(times), 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json is added)")
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (checks the script)")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.smoke)), flush=True)
        return 0
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "runs": []}
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix=f"glue-{mode}-") as tmp:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "TRITON_CACHE_DIR": f"{tmp}/triton"}
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", mode]
                                  + (["--smoke"] if args.smoke else []), env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            run = json.loads(lines[-1][7:]) if lines else {"mode": mode, "error": proc.stderr[-3000:]}
            run["process_s"] = round(time.perf_counter() - t0, 1)
            doc["runs"].append(run)
            Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
            print(json.dumps(run), flush=True)
    print(f"\n{'mode':<12} {'process s':>9} {'capture s':>9}  " + "  ".join(f"{r:>3}-row step ms" for r in ROWS))
    for run in doc["runs"]:
        steps = run.get("step_ms", {})
        print(f"{run['mode']:<12} {run.get('process_s', 0):>9} {run.get('capture_s', '-'):>9}  "
              + "  ".join(f"{steps.get(str(r), '-'):>15}" for r in ROWS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
