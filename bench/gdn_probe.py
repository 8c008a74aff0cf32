"""Time the Gated DeltaNet decode token on one GPU: the one-kernel Triton version (gdn.gdn_decode, several warp
counts) against the Inductor-compiled reference (glue.gdn_step), each as 24 calls (one per layer, each with
its own state, as in the 9B) captured in a CUDA graph (``tp_probe.graph_us``: median of 5 timings; run 1 of
2026-11-30 timed one mean over 200 replays, run 2 this way).  Head sizes of the 9B (dk = dv = 128, 2 value heads per
key head); 32 value heads = one GPU, 16 = one rank of TP=2.

    python bench/gdn_probe.py --out OUTDIR        # prints a table, writes OUTDIR/<date>-<gpu>-gdn-probe.json
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qwen_chat.engine.model import gdn, glue  # noqa: E402
from tp_probe import graph_us  # noqa: E402  (bench/ is sys.path[0] when run as a script)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated  # noqa: E402

LAYERS, DK, DV, K = 24, 128, 128, 4


def build(HV: int, B: int, slots: int):
    nk = HV // 2
    key_dim = nk * DK
    C = 2 * key_dim + HV * DV
    dev, dt = "cuda", torch.bfloat16
    layers = []
    for _ in range(LAYERS):
        norm = Qwen3_5RMSNormGated(DV, eps=1e-6).to(dev, dt)
        layers.append(dict(conv=torch.randn(slots, C, K, device=dev, dtype=dt),
                           rec=torch.randn(slots, HV, DV, DK, device=dev) * 0.05,
                           w=torch.randn(C, K, device=dev, dtype=dt) * 0.5,
                           A_log=torch.randn(HV, device=dev, dtype=dt), dt_bias=torch.randn(HV, device=dev, dtype=dt),
                           norm=norm))
    proj = torch.randn(B, C + HV * DV + 2 * HV, device=dev, dtype=dt)
    qkv, z, b, a = proj.split([C, HV * DV, HV, HV], dim=-1)
    slot_idx = torch.arange(B, device=dev)
    pos = torch.full((B,), 300, device=dev, dtype=torch.long)
    return layers, (qkv, z, b, a), slot_idx, pos, key_dim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    compiled = torch.compile(glue.gdn_step, fullgraph=True)
    rows = []
    for HV in (32, 16):
        for B in (1, 4, 16):
            layers, (qkv, z, b, a), slot_idx, pos, key_dim = build(HV, B, slots=B + 1)
            res = dict(value_heads=HV, rows=B)

            layer = itertools.cycle(layers)  # each captured call works on the next layer's own state

            def ref():
                L = next(layer)
                compiled(qkv, z, b, a, L["conv"], L["rec"], slot_idx, pos, L["w"], L["A_log"], L["dt_bias"],
                         L["norm"], "silu", key_dim, DK, DV)
            res["compiled_us"] = round(graph_us(ref, calls=LAYERS), 2)
            for nw in (4, 8, 16):
                def ker(nw=nw):
                    L = next(layer)
                    gdn.gdn_decode(qkv, z, b, a, L["conv"], L["rec"], slot_idx, pos, L["w"], L["A_log"],
                                   L["dt_bias"], L["norm"].weight, 1e-6, key_dim, DK, DV, num_warps=nw)
                res[f"kernel_w{nw}_us"] = round(graph_us(ker, calls=LAYERS), 2)
            state_mb = B * HV * DV * DK * 4 * 2 / 1e6
            best = min(v for k_, v in res.items() if k_.startswith("kernel"))
            res["state_rw_MB"] = round(state_mb, 2)
            res["best_kernel_GBps"] = round(state_mb / best * 1e3, 0)
            rows.append(res)
            del layers
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                command="python bench/gdn_probe.py --out OUTDIR", rows=rows)
    path = args.out / f"{meta['date']}-{gpu}-gdn-probe.json"
    path.write_text(json.dumps(meta, indent=1))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
