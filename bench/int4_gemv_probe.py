"""The W4A16 decode GEMV (qwen_chat.engine.model.int4_gemv) on the 9B's decode shapes: correctness on CUDA and
time against the bf16 and FP8 paths.

Usage (one GPU host, repository root; a few minutes on an H200, ``--quick`` about one):

    python bench/int4_gemv_probe.py [--quick] [--save-tiles] [--out DIR]

For each projection of the full config on one GPU (MLP gate/up fused, down, Gated DeltaNet in_proj_qkv +
in_proj_z fused, out_proj / o_proj, attention q/k/v fused) and B = 1, 4, 16, 32, 64 rows:

- ``check``: the 4-bit kernel's output against x @ dequantised(w)^T computed in fp32 from the same bf16
  activations (relative error, max |diff| / max |ref|; bf16 output rounding is 2^-9, so <= 4e-3 passes), and the
  dequantisation kernel against PyTorch's (bit for bit) once per shape;
- times (``gemv_probe.graph_time``: a CUDA graph rotating over >= 256 MiB of weights so L2 cannot serve them):
  ``int4`` (``int4_gemv.pick_config``'s tiles), ``int4_best`` (a sweep of BLOCK_N / R / BLOCK_B / warps for B = 1, 4, 32, 64
  unless ``--quick``), ``int4_dequant_matmul`` (what prefill and batches above 64 rows do: dequantise, then cuBLAS),
  ``fp8`` (the FP8 GEMV, ``fp8_gemv``) and ``bf16`` (the bf16 Triton GEMV up to 16 rows, else cuBLAS);
  GB/s = bytes of the weight read / time (4-bit: half a byte per weight + scales + zero points).

With ``--save-tiles`` the best tiles of B = 1, 4, 32 and 64 (the batch classes 1, 2-16, 17-32, 33-64) go to
``qwen_chat/engine/model/int4_tiles.json``, which ``int4_gemv.pick_config`` reads (merged into the file's other
entries after each shape).  Writes <out>/<date>-<gpu>-int4-gemv-probe.json (and a copy in $OUT/) after every
shape, prints a table last and exits 1 when a correctness check failed.
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

from qwen_chat.engine.model import fp8, fp8_gemv, gemv, int4, int4_gemv  # noqa: E402

SHAPES = {  # name: (N, K) of the decoder's quantised GEMMs, one GPU; most bytes first
    "mlp_gate_up": (24576, 4096), "mlp_down": (4096, 12288), "gdn_in_proj(qkv+z)": (12288, 4096),
    "out_proj/o_proj": (4096, 4096), "attn_qkv": (10240, 4096),
}
BATCHES = (1, 4, 16, 32, 64)
#: Batches whose tiles are swept (4 stands for 2-16 rows).
SWEPT = (1, 4, 32, 64)
#: Relative error bound of the CUDA check: a few roundings of the bf16 output (2^-9 each).
CHECK_TOL = 4e-3


def configs(B: int, K: int):
    """Tiles swept: one row, the row kernel with BLOCK_N 8-64, R 1-4 groups per iteration, 4 or 8 warps (24);
    more rows, the dot kernel with BLOCK_B 16 and the batch's own, BLOCK_N 16-128, 4 or 8 warps (8-16)."""
    if B == 1:
        for bn, r, nw in itertools.product((8, 16, 32, 64), (1, 2, 4), (4, 8)):
            if (K // 128) % r == 0:
                yield dict(BLOCK_N=bn, R=r, num_warps=nw, num_stages=3)
        return
    own = 16 if B <= 16 else 32 if B <= 32 else 64
    for bb, bn, nw in itertools.product(sorted({16, own}), (16, 32, 64, 128), (4, 8)):
        yield dict(BLOCK_B=bb, BLOCK_N=bn, num_warps=nw, num_stages=3)


def timing(fns, nbytes: int) -> dict:
    t = graph_time(fns)
    return {"us": t * 1e6, "gb_s": nbytes / t / 1e9}


def probe(name: str, N: int, K: int, quick: bool) -> dict:
    w = torch.randn(N, K, device="cuda") * 0.02
    q = int4.quantize_groups(w)
    nbytes = q.nbytes
    copies = max(1, -(-(256 << 20) // nbytes))
    qs = [int4.Int4Weight(q.packed.clone(), q.scale.clone(), q.zero.clone()) for _ in range(copies)]
    f8 = fp8.quantize_blocks(w)
    f8s = [fp8.Fp8Weight(f8.data.clone(), f8.scale.clone()) for _ in range(max(1, -(-(256 << 20) // f8.nbytes)))]
    bf = [w.to(torch.bfloat16) for _ in range(max(1, -(-(256 << 20) // (2 * N * K))))]
    deq_bf16 = q.dequantize(torch.bfloat16)
    res = {"N": N, "K": K, "int4_mb": nbytes / 2 ** 20,
           "dequant_equal": torch.equal(q.dequantize(torch.float32),
                                        _torch_dequantize(q)), "by_batch": {}}
    del w
    for B in BATCHES:
        x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
        y = int4_gemv.gemv_int4(x, q.packed, q.scale, q.zero)
        ref = x.float() @ deq_bf16.float().t()
        row = {"check_rel_err": float((y.float() - ref).abs().max() / ref.abs().max())}
        outs = [torch.empty(B, N, device="cuda", dtype=torch.bfloat16) for _ in qs]
        row["int4"] = {"config": int4_gemv.pick_config(B, N, K),
                       **timing([lambda v=v, o=o: int4_gemv.gemv_int4(x, v.packed, v.scale, v.zero, out=o)
                                 for v, o in zip(qs, outs)], nbytes)}
        best = None
        for cfg in ([] if quick or B not in SWEPT else configs(B, K)):
            try:
                t = timing([lambda v=v, o=o: int4_gemv.gemv_int4(x, v.packed, v.scale, v.zero, out=o, config=cfg)
                            for v, o in zip(qs, outs)], nbytes)
            except Exception as exc:  # a config Triton cannot compile (registers, shared memory)
                row.setdefault("failed", []).append(f"{cfg}: {type(exc).__name__}")
                continue
            if best is None or t["us"] < best["us"]:
                best = {"config": cfg, **t}
        if best:
            row["int4_best"] = best
        row["int4_dequant_matmul"] = timing([lambda v=v: F.linear(x, v.dequantize(torch.bfloat16)) for v in qs[:4]],
                                            nbytes)
        if fp8_gemv.supports(x, f8.data, f8.scale):
            row["fp8"] = timing([lambda v=v: fp8_gemv.gemv_fp8(x, v.data, v.scale) for v in f8s], f8.nbytes)
        if gemv.supports(x, bf[0]):
            row["bf16"] = {"kernel": "triton", **timing([lambda v=v: gemv.gemv(x, v) for v in bf], 2 * N * K)}
        else:
            row["bf16"] = {"kernel": "cublas", **timing([lambda v=v: F.linear(x, v) for v in bf], 2 * N * K)}
        res["by_batch"][str(B)] = row
        print(f"{name:20s} B={B:2d} err {row['check_rel_err']:.1e}  int4 {row['int4']['us']:7.1f} us "
              f"({row['int4']['gb_s']:5.0f} GB/s)  best {row.get('int4_best', {}).get('us', 0):7.1f}  "
              f"fp8 {row.get('fp8', {}).get('us', 0):7.1f}  bf16 {row['bf16']['us']:7.1f} us", flush=True)
    del qs, f8s, bf
    torch.cuda.empty_cache()
    return res


def _torch_dequantize(q: int4.Int4Weight) -> torch.Tensor:
    """PyTorch's dequantisation (the path ``Int4Weight.dequantize`` takes off CUDA), on the GPU."""
    n, k = q.shape
    vals = int4.unpack(q.packed).view(n, k // 128, 128).float()
    return ((vals - q.zero.float()[:, :, None]) * q.scale[:, :, None]).view(n, k)


def tiles_doc(doc: dict) -> dict:
    """The best tiles per (batch class, N, K) of a probe's results in ``int4_gemv.TILES_FILE``'s layout (a tile
    only where the sweep beat the default by more than 1%, else the default's), merged over the file's entries."""
    tiles = {}
    for r in doc["shapes"].values():
        for B, row in r["by_batch"].items():
            best, default = row.get("int4_best"), row["int4"]
            if best is None:
                continue
            pick = best if best["us"] < 0.99 * default["us"] else default
            tiles[f"{int4_gemv.batch_class(int(B))}:{r['N']}:{r['K']}"] = dict(pick["config"])
    try:
        kept = json.loads(int4_gemv.TILES_FILE.read_text()).get("tiles", {})
    except (OSError, ValueError):
        kept = {}
    return {"source": {**doc["env"], "date_utc": doc["date_utc"],
                       "note": "best tiles of bench/int4_gemv_probe.py (int4_gemv.pick_config reads them)"},
            "tiles": {**kept, **tiles}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="default tiles only (no sweep)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--save-tiles", action="store_true",
                    help=f"write the best tiles to {int4_gemv.TILES_FILE.relative_to(ROOT)} (read by pick_config)")
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    now = dt.datetime.now(dt.timezone.utc)
    stem = f"{now:%Y-%m-%d}-{gpu}-int4-gemv-probe"
    doc = {"date_utc": now.isoformat(timespec="seconds"),
           "env": {"gpu": gpu, "torch": torch.__version__, "triton": int4_gemv.triton.__version__,
                   "command": " ".join(["python", "bench/int4_gemv_probe.py"] + (argv or sys.argv[1:]))},
           "shapes": {}}
    paths = [args.out / f"{stem}.json"] + ([Path(os.environ["OUT"]) / f"{stem}.json"] if os.environ.get("OUT") else [])
    for name, (N, K) in SHAPES.items():
        doc["shapes"][name] = probe(name, N, K, args.quick)
        for p in paths:  # after every shape: a cut-short run keeps what it measured
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(doc, indent=1))
        if args.save_tiles and not args.quick:
            int4_gemv.TILES_FILE.write_text(json.dumps(tiles_doc(doc), indent=1) + "\n")
    failed = []
    print(f"\n{'shape':20s} {'B':>3s} {'rel err':>8s} {'int4 us':>8s} {'GB/s':>5s} {'best us':>8s} {'deq+mm':>8s} "
          f"{'fp8 us':>8s} {'bf16 us':>8s}  best tiles")
    for name, r in doc["shapes"].items():
        if not r["dequant_equal"]:
            failed.append(f"{name}: dequantisation kernel differs from PyTorch")
        for B, row in r["by_batch"].items():
            if not row["check_rel_err"] <= CHECK_TOL:
                failed.append(f"{name} B={B}: relative error {row['check_rel_err']:.2e}")
            best = row.get("int4_best", {})
            print(f"{name:20s} {B:>3s} {row['check_rel_err']:8.1e} {row['int4']['us']:8.1f} {row['int4']['gb_s']:5.0f} "
                  f"{best.get('us', float('nan')):8.1f} {row['int4_dequant_matmul']['us']:8.1f} "
                  f"{row.get('fp8', {}).get('us', float('nan')):8.1f} {row['bf16']['us']:8.1f}  {best.get('config', '')}")
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
