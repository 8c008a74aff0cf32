"""GPU probe: the transient memory and time of the compiled decode attention (``glue.attn_core``) at the shapes
of Qwen3.5-9B on one GPU (4 KV heads, 4 query heads per KV head, head dim 256, 64-token blocks), for a bf16 and
an FP8 KV cache, whole and split into row groups (``memory.attention_rows``).

For each (rows B, context window ctx) it reports the peak memory the call allocates beyond its inputs and
output (``torch.cuda.max_memory_allocated``), the median time of 5 calls (CUDA events), the largest difference
between the whole and the grouped result, and what the memory plan keeps for it (``memory.scores_reserve``).
The cache holds one window of blocks; every row reads the same blocks (the memory and the work are those of B
different sequences, the cache is not).

    python bench/attn_memory_probe.py --out OUT.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_chat.engine.model import glue, kv_quant, memory  # noqa: E402

NKV, GROUP, HD, BT = 4, 4, 256, 64
CASES = ((128, 32768), (128, 131072), (32, 131072), (8, 262144))


def cache(ctx: int, kv_dtype):
    """Keys or values [ctx / BT, BT, NKV, HD] in ``kv_dtype`` (FP8: with fp32 scales [.., NKV])."""
    x = torch.randn(ctx // BT, BT, NKV, HD, device="cuda", dtype=torch.bfloat16)
    if kv_dtype is None:
        return x, None
    q, s = kv_quant.quantize(x)
    return q, s


def measure(fn, args, out_bytes: int) -> tuple[float, float, torch.Tensor]:
    """(peak MiB beyond inputs and output, median ms of 5 calls, the result) of ``fn(*args)`` (called once
    before, to compile)."""
    fn(*args)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base - out_bytes) / 2 ** 20
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return peak, sorted(times)[2], out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    whole = torch.compile(glue.attn_core, fullgraph=True)   # what glue_functions(True) wraps
    grouped = glue.glue_functions(True)["attn_core"]
    rows_out = []
    for kv_dtype in (None, kv_quant.FP8):
        for B, ctx in CASES:
            torch.manual_seed(0)
            kc, ks = cache(ctx, kv_dtype)
            vc, vs = cache(ctx, kv_dtype)
            q = torch.randn(B, NKV, GROUP, HD, device="cuda", dtype=torch.bfloat16)
            blocks = torch.arange(ctx // BT, device="cuda").repeat(B, 1)
            pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int64)
            call = (q, kc, vc, blocks, pos, HD ** -0.5, ks, vs)
            out_bytes = q.numel() * q.element_size()
            t0 = time.monotonic()
            row = {"kv": "fp8" if kv_dtype is not None else "bf16", "rows": B, "ctx": ctx,
                   "rows_per_group": memory.attention_rows(NKV * GROUP, ctx),
                   "plan_reserve_mib": memory.scores_reserve(B, NKV * GROUP, ctx) / 2 ** 20,
                   "old_plan_reserve_mib": 2 * B * NKV * GROUP * 4 * ctx / 2 ** 20}
            try:
                row["whole_peak_mib"], row["whole_ms"], a = measure(whole, call, out_bytes)
            except torch.OutOfMemoryError as exc:
                row["whole_error"], a = str(exc).splitlines()[0], None
                torch.cuda.empty_cache()
            row["grouped_peak_mib"], row["grouped_ms"], b = measure(grouped, call, out_bytes)
            if a is not None:
                row["max_abs_diff"] = float((a.float() - b.float()).abs().max())
            row["wall_s"] = round(time.monotonic() - t0, 1)
            print(json.dumps(row), flush=True)
            rows_out.append(row)
            del kc, vc, ks, vs, q, blocks, a, b
            torch.cuda.empty_cache()
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "command": "python bench/attn_memory_probe.py --out OUT.json",
              "geometry": {"kv_heads": NKV, "query_heads": NKV * GROUP, "head_dim": HD, "block_tokens": BT},
              "scores_bytes_max_mib": memory.SCORES_BYTES_MAX / 2 ** 20, "cases": rows_out}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{'kv':5} {'rows':>5} {'ctx':>7} {'group':>6} {'whole MiB':>10} {'grouped MiB':>12} {'old plan':>9} "
          f"{'new plan':>9} {'whole ms':>9} {'grouped ms':>11} {'diff':>8}")
    for r in rows_out:
        print(f"{r['kv']:5} {r['rows']:>5} {r['ctx']:>7} {r['rows_per_group']:>6} "
              f"{r.get('whole_peak_mib', float('nan')):>10.0f} {r['grouped_peak_mib']:>12.0f} "
              f"{r['old_plan_reserve_mib']:>9.0f} {r['plan_reserve_mib']:>9.0f} {r.get('whole_ms', float('nan')):>9.2f} "
              f"{r['grouped_ms']:>11.2f} {r.get('max_abs_diff', float('nan')):>8.1e}")


if __name__ == "__main__":
    main()
