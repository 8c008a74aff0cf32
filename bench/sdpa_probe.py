"""First call against later calls of the prefill's attention (``F.scaled_dot_product_attention`` as
``forward.ModelForward.attn_core`` calls it: 16 query heads over 4 KV heads of 256, bf16) for shapes it has not
seen, per SDPA backend: a backend that builds an execution plan per shape (cuDNN) makes every new prompt or chunk
length wait for the build.  New chunks (causal) and continuing chunks (bottom-right causal over cached keys).

    python bench/sdpa_probe.py --out bench/results/<date>-<gpu>-sdpa-probe   # writes <out>.json, prints a table
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import timed  # noqa: E402

BACKENDS = {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION]}


def call(q, k, v, start: int, backend):
    def run():
        if start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if backend is None:
        return run()
    with sdpa_kernel(backend):
        return run()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": []}
    for b_i, (name, backend) in enumerate(BACKENDS.items()):
        for n, start in ((317 + b_i, 0), (523 + b_i, 0), (211 + b_i, 600), (97 + b_i, 1200)):
            q = torch.randn(1, 16, n, 256, generator=gen).to(dev, torch.bfloat16)
            k = torch.randn(1, 4, start + n, 256, generator=gen).to(dev, torch.bfloat16)
            v = torch.randn(1, 4, start + n, 256, generator=gen).to(dev, torch.bfloat16)
            row = {"backend": name, "q": n, "kv": start + n}
            try:
                row["first_ms"] = timed(lambda: call(q, k, v, start, backend), dev)[0] * 1e3
                row["second_ms"] = timed(lambda: call(q, k, v, start, backend), dev)[0] * 1e3
                out = call(q, k, v, start, backend).float()
                qf, kf, vf = (t.float() for t in (q, k, v))
                want = call(qf, kf, vf, start, [SDPBackend.MATH])
                row["rel_err_vs_fp32_math"] = float((out - want).norm() / want.norm())
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is recorded
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
    print(f"\n## SDPA first vs second call, {doc['device']}, torch {doc['torch']}")
    print("| backend | q | kv | first ms | second ms | rel err vs fp32 |\n|---|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['backend']} | {r['q']} | {r['kv']} | {r.get('first_ms', float('nan')):.1f} | "
              f"{r.get('second_ms', float('nan')):.2f} | {r.get('rel_err_vs_fp32_math', r.get('error'))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
