"""What the run-time check for non-finite logits costs per decode step, next to the draw it accompanies.

Usage (repository root):  python bench/nonfinite_probe.py [--device cuda|cpu] [--out DIR] [--quick]

For batches of B = 1, 8, 32, 64, 128 rows of Qwen3.5's 248,320 logits (fp32, as the runner returns them):
the time of ``sampling_rules.mark_nonfinite`` (one row sum + isfinite + where, what the executor adds to each
draw) and of ``Sampler.sample_async`` for greedy rows and for Qwen's sampling preset (top-k 20, top-p 0.95,
temperature 0.7), each as the mean of ``--iters`` eager calls between two device synchronisations (launch
overhead included, as in the engine's step).  Prints a table; writes
<out>/<date>-<device>-nonfinite-probe.json.
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

from qwen_chat.engine.model.sampling import Sampler  # noqa: E402
from qwen_chat.engine.model.sampling_rules import mark_nonfinite  # noqa: E402
from qwen_chat.engine.types import SamplingParams  # noqa: E402

VOCAB = 248320  # Qwen3.5's vocabulary (docs/facts.md)


def timed(fn, device: torch.device, iters: int) -> float:
    """Mean seconds per call of ``fn()`` over ``iters`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--quick", action="store_true", help="B = 1 and 8 only, 10 iterations")
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = (1, 8) if args.quick else (1, 8, 32, 64, 128)
    iters = 10 if args.quick else 200
    rows = []
    for b in batches:
        sampler = Sampler(b, VOCAB, device)
        slots = list(range(b))
        logits = torch.randn(b, VOCAB, device=device) * 4
        tokens = torch.zeros(b, dtype=torch.long, device=device)
        row = {"batch": b}
        row["check_s"] = timed(lambda: mark_nonfinite(logits, tokens), device, iters)
        for name, params in (("greedy", SamplingParams(0.0, 1.0, 0, 0.0, 0, 256, ())),
                             ("top_k20", SamplingParams(0.7, 0.95, 20, 0.0, 0, 256, ()))):
            for s in slots:
                sampler.start(s, params)
            sampler.warm_up()
            row[f"draw_{name}_s"] = timed(lambda: sampler.sample_async(slots, logits), device, iters)
        bad = logits.clone()
        bad[b // 2, 7] = float("nan")
        row["flags_the_bad_row"] = mark_nonfinite(bad, tokens).tolist() == [
            -1 if i == b // 2 else 0 for i in range(b)]
        rows.append(row)
        print(f"B={b:4d}  check {row['check_s'] * 1e6:8.1f} us  greedy draw {row['draw_greedy_s'] * 1e6:8.1f} us"
              f"  top-k draw {row['draw_top_k20_s'] * 1e6:8.1f} us  flags NaN row: {row['flags_the_bad_row']}")
    name = torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "cpu"
    out = Path(args.out) / f"{dt.date.today().isoformat()}-{name}-nonfinite-probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "vocab": VOCAB, "iters": iters, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
