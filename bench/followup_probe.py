"""Engine-level probe of a conversation's follow-up turn (for kernel work; the service's number is
``serve_bench.py``'s ``followup_ttft_ms``): the full published config with random bf16 weights on one GPU, a
history of 8k / 30k tokens prefilled with a keep point 3 tokens before its end, then a follow-up chunk of 50 new
tokens started from the kept state (``ModelRunner.restore`` + ``prefill_batch``), timed (synchronised, median
of 5) and profiled (wall time, summed GPU kernel time, top CPU ops), next to a 50-token first prompt.

Usage: ``python bench/followup_probe.py [--out PREFIX]``; writes PREFIX.json (default
bench/results/<date>-<gpu>-followup-probe.json) and prints a table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tp_probe import build_model  # noqa: E402

from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PrefillItem  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def profile(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    ev = prof.key_averages()
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)  # noqa
    gpu = sorted(((dev_t(e), e.count, e.key) for e in ev if dev_t(e) > 0), reverse=True)
    cpu = sorted(((e.self_cpu_time_total, e.count, e.key) for e in ev), reverse=True)
    return {"wall_ms_profiled": wall, "gpu_kernel_ms": sum(g[0] for g in gpu) / 1e3,
            "kernel_launches": sum(g[1] for g in gpu),
            "top_gpu": [{"name": k[:90], "ms": t / 1e3, "calls": c} for t, c, k in gpu[:8]],
            "top_cpu_self": [{"name": k[:90], "ms": t / 1e3, "calls": c} for t, c, k in cpu[:12]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(dev)
    runner = ModelRunner(model, num_slots=4, max_context=40960, num_blocks=1400, device=dev)
    gen = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, 240000, (n,), generator=gen)  # noqa: E731
    doc = {"date": dt.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python bench/followup_probe.py", "impl": runner.impl, "cases": {}}
    first = PreparedPrompt(input_ids=ids(50))
    runner.prefill(0, first)  # warm-up (kernels compiled)
    runner.free(0)
    fresh = [timed(lambda: (runner.free(0), runner.prefill(0, first))) for _ in range(5)]
    doc["cases"]["first_50"] = {"ms_p50": statistics.median(fresh), "profile": profile(
        lambda: (runner.free(0), runner.prefill(0, first)))}
    for label, n in (("8k", 8000), ("30k", 30000)):
        hist = ids(n)
        runner.free(0), runner.free(1), runner.free(3)
        keep = n - 3
        runner.prefill_batch([PrefillItem(0, PreparedPrompt(input_ids=hist), keeps=((keep, 3),))])
        follow = PreparedPrompt(input_ids=torch.cat([hist[:keep], ids(50)]))

        def once():
            runner.free(1)
            runner.restore(3, 1)
            runner.prefill_batch([PrefillItem(1, follow, start=keep)])
        once()
        times = [timed(once) for _ in range(5)]
        doc["cases"][f"followup_{label}"] = {"history": n, "new_tokens": follow.num_tokens - keep,
                                             "ms_p50": statistics.median(times), "profile": profile(once)}
    out = args.out or Path("bench/results") / f"{doc['date']}-{doc['gpu'].replace(' ', '-')}-followup-probe"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    for name, c in doc["cases"].items():
        p = c["profile"]
        print(f"{name:14s} {c['ms_p50']:8.1f} ms  (profiled wall {p['wall_ms_profiled']:.1f} ms, GPU kernels "
              f"{p['gpu_kernel_ms']:.1f} ms, {p['kernel_launches']} launches)")
        for e in p["top_cpu_self"][:6]:
            print(f"    cpu {e['ms']:7.2f} ms x{e['calls']:5d}  {e['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
