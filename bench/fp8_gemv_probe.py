"""The FP8 decode GEMV (qwen_chat.engine.model.fp8_gemv) on the 9B's decode shapes: GB/s against the bf16 GEMV.

Usage (one GPU host, repository root; about 2 minutes on an H200, ``--quick`` under one):

    python bench/fp8_gemv_probe.py [--quick] [--save-tiles]

For each FP8 projection of the full config on one GPU (Gated DeltaNet in_proj_qkv + in_proj_z fused, attention
q/k/v fused, out_proj / o_proj, MLP gate/up fused, down) and B = 1, 4, 16, 32, 64 rows: the kernels' default
tiles (``fp8_gemv.pick_config``) and, unless ``--quick``, a sweep of tile sizes; the bf16 Triton GEMV
(``gemv``, up to 16 rows) and cuBLAS on the same shape for comparison.  Timing: ``gemv_probe.graph_time`` (a
CUDA graph of calls rotating over >= 256 MiB of weights, so L2 cannot serve them).  GB/s = bytes of the weight
read (FP8: 1 per weight + the scales; bf16: 2) / time.  With ``--save-tiles`` the best tiles of B = 1, 4, 32 and 64 (the
batch classes 1, 2-16, 17-32, 33-64) go to ``qwen_chat/engine/model/fp8_tiles.json``, which
``fp8_gemv.pick_config`` reads (after each shape, merged into the file's other entries, so a cut-short run keeps
the tiles of the shapes it did not reach); writes <out>/<date>-<gpu>-fp8-gemv-probe.json (and $OUT/) and prints a table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gemv_probe import graph_time  # noqa: E402

from qwen_chat.engine.model import fp8, fp8_gemv, gemv  # noqa: E402

SHAPES = {  # name: (N, K) of the FP8 GEMMs of the full config, one GPU (in_proj_b/a stay bf16); most bytes first
    "mlp_gate_up": (24576, 4096), "mlp_down": (4096, 12288), "gdn_in_proj(qkv+z)": (12288, 4096),
    "out_proj/o_proj": (4096, 4096), "attn_qkv": (10240, 4096),
}
BATCHES = (1, 4, 16, 32, 64)
#: Batches whose best tiles are saved for their class (``fp8_gemv.batch_class``): 4 stands for 2-16 rows.
SWEPT = (1, 4, 32, 64)


def configs(B: int, K: int):
    """The tiles swept.  One row: the row kernel with tiles of 4, 8 or 16 KiB of weight (BLOCK_N x BLOCK_K) at
    4 and 8 warps, and the dot kernel (16 padded rows) with BLOCK_N 16-64 and 256-1024 columns per iteration:
    35 per shape.  More rows: the dot kernel's BLOCK_B 16 and the batch's class x BLOCK_N x BLOCK_K: 9-18."""
    if B == 1:
        for bn, bk in itertools.product((2, 4, 8, 16, 32), (256, 512, 1024, 2048, 4096)):
            if bn * bk in (4096, 8192, 16384) and K % bk == 0:
                for nw in (4, 8):
                    yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3)
    for bb, bn, bk in itertools.product(sorted({16, int(fp8_gemv.batch_class(B))}), (16, 32, 64), (256, 512, 1024)):
        yield dict(BLOCK_B=bb, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3)


def probe(name: str, N: int, K: int, quick: bool) -> dict:
    q = fp8.quantize_blocks(torch.randn(N, K, device="cuda") * 0.02)
    nbytes = q.nbytes
    copies = max(1, -(-(256 << 20) // nbytes))
    ws = [fp8.Fp8Weight(q.data.clone(), q.scale.clone()) for _ in range(copies)]
    bf = [q.dequantize(torch.bfloat16) for _ in range(max(1, copies // 2))]
    res = {"N": N, "K": K, "fp8_mb": nbytes / 2 ** 20, "by_batch": {}}
    for B in BATCHES:
        x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(B, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
        row = {}
        t = graph_time([lambda w=w, o=o: fp8_gemv.gemv_fp8(x, w.data, w.scale, out=o) for w, o in zip(ws, outs)])
        row["fp8_default"] = {"config": fp8_gemv.pick_config(B, N, K), "us": t * 1e6, "gb_s": nbytes / t / 1e9}
        best = None
        for cfg in ([] if quick or B not in SWEPT else configs(B, K)):
            try:
                t = graph_time([lambda w=w, o=o: fp8_gemv.gemv_fp8(x, w.data, w.scale, out=o, config=cfg)
                                for w, o in zip(ws, outs)])
            except Exception as exc:  # a config Triton cannot compile (registers, shared memory)
                row.setdefault("failed", []).append(f"{cfg}: {type(exc).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        if best:
            row["fp8_best"] = {"config": best[1], "us": best[0] * 1e6, "gb_s": nbytes / best[0] / 1e9}
        t = graph_time([lambda w=w: F.linear(x, w) for w in bf])
        row["bf16_cublas"] = {"us": t * 1e6, "gb_s": 2 * N * K / t / 1e9}
        if gemv.supports(x, bf[0]):
            t = graph_time([lambda w=w: gemv.gemv(x, w) for w in bf])
            row["bf16_triton"] = {"us": t * 1e6, "gb_s": 2 * N * K / t / 1e9}
        res["by_batch"][str(B)] = row
        print(f"{name:20s} B={B:2d} fp8 default {row['fp8_default']['us']:7.1f} us "
              f"({row['fp8_default']['gb_s']:5.0f} GB/s)  best {row.get('fp8_best', {}).get('us', 0):7.1f} us "
              f"{row.get('fp8_best', {}).get('config')}  bf16 {row.get('bf16_triton', row['bf16_cublas'])['us']:7.1f} us",
              flush=True)
    del ws, bf
    torch.cuda.empty_cache()
    return res


def tiles_doc(doc: dict) -> dict:
    """The best tiles per (batch class, N, K) of a probe's results, in ``fp8_gemv.TILES_FILE``'s layout (a tile
    only where the sweep beat the default by more than 1%, else the default's), merged over the file's entries."""
    tiles = {}
    for r in doc["shapes"].values():
        for B, row in r["by_batch"].items():
            best, default = row.get("fp8_best"), row["fp8_default"]
            if best is None:  # not swept (batch not in SWEPT, or --quick)
                continue
            pick = best if best["us"] < 0.99 * default["us"] else default
            tiles[f"{fp8_gemv.batch_class(int(B))}:{r['N']}:{r['K']}"] = dict(pick["config"])
    try:  # entries this run did not measure (other shapes) are kept
        kept = json.loads(fp8_gemv.TILES_FILE.read_text()).get("tiles", {})
    except (OSError, ValueError):
        kept = {}
    return {"source": {**doc["env"], "date_utc": doc["date_utc"],
                       "note": "best tiles of bench/fp8_gemv_probe.py (fp8_gemv.pick_config reads them)"},
            "tiles": {**kept, **tiles}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="default tiles only (no sweep)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--save-tiles", action="store_true",
                    help=f"write the best tiles to {fp8_gemv.TILES_FILE.relative_to(ROOT)} (read by pick_config)")
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    now = dt.datetime.now(dt.timezone.utc)
    stem = f"{now:%Y-%m-%d}-{gpu}-fp8-gemv-probe"
    doc = {"date_utc": now.isoformat(timespec="seconds"),
           "env": {"gpu": gpu, "torch": torch.__version__, "triton": fp8_gemv.triton.__version__,
                   "command": " ".join(["python", "bench/fp8_gemv_probe.py"] + (argv or sys.argv[1:]))},
           "shapes": {}}
    paths = [args.out / f"{stem}.json"] + ([Path(os.environ["OUT"]) / f"{stem}.json"] if os.environ.get("OUT") else [])
    for name, (N, K) in SHAPES.items():
        doc["shapes"][name] = probe(name, N, K, args.quick)
        for p in paths:  # after every shape: a cut-short run keeps what it measured
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(doc, indent=1))
        if args.save_tiles and not args.quick:
            fp8_gemv.TILES_FILE.write_text(json.dumps(tiles_doc(doc), indent=1) + "\n")
    print(f"\n{'shape':20s} {'B':>3s} {'fp8 default us':>15s} {'GB/s':>5s} {'fp8 best us':>12s} {'GB/s':>5s} "
          f"{'bf16 us':>9s}  best tiles")
    for name, r in doc["shapes"].items():
        for B, row in r["by_batch"].items():
            bf16 = row.get("bf16_triton", row["bf16_cublas"])["us"]
            best = row.get("fp8_best", {})
            print(f"{name:20s} {B:>3s} {row['fp8_default']['us']:15.1f} {row['fp8_default']['gb_s']:5.0f} "
                  f"{best.get('us', float('nan')):12.1f} {best.get('gb_s', float('nan')):5.0f} {bf16:9.1f}  "
                  f"{best.get('config', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
