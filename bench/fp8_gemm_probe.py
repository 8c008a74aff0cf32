"""Whether FP8 tensor-core GEMMs would pay for prefill and large decode batches on this GPU: PyTorch's
block-scaled ``torch.nn.functional.scaled_mm`` (activations quantised per token and 128 columns, the weight's own
128 x 128 block scales, as the published FP8 checkpoints store them) against what the engine does now for more
than ``fp8_gemv.MAX_ROWS`` rows (``fp8.linear``: the layer dequantised to bf16 by one Triton pass, then cuBLAS;
up to that many rows its FP8 GEMV) and against a bf16 weight (cuBLAS).

For Qwen3.5-9B's projection shapes (docs/facts.md) and M rows (default 64, 256, 1,024, 4,096: a large decode
batch up to a full 4,096-token prefill step): milliseconds per call (CUDA events, median of ``--iters`` after a
warm-up), the scaled GEMM alone and with the activations' quantisation, and each path's relative error
(max |y - ref| / max |ref|) against fp32 on the same FP8 weight dequantised.  Each layout the block-scaled GEMM
may want is tried in turn (cuBLAS wants the weight column-major, the activation scales outer-dim-major, rows and
K blocks padded to multiples of 4, per the public examples); the first that gives the reference's numbers is
kept and named in the output, the others' errors listed.

Usage (one GPU; engine modules only, no service):
    python bench/fp8_gemm_probe.py --out bench/results/DATE-GPU-fp8-gemm-probe.json
    python bench/fp8_gemm_probe.py --rows 512 4096 --iters 10
Prints a table last.  Nothing here changes the engine: it says whether a scaled-GEMM path is worth building.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qwen_chat.engine.model import fp8  # noqa: E402

#: (name, N, K) of the 9B's projections (docs/facts.md): out, in features
SHAPES = [("mlp gate/up", 24576, 4096), ("mlp down", 4096, 12288), ("gdn in_proj", 12288, 4096),
          ("o_proj / out_proj", 4096, 4096), ("attn q/k/v", 10240, 4096)]
GROUP = 128


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] -> (e4m3 [M, K], fp32 scales [M, K / 128]): per row and 128 columns, scale = amax / 448."""
    m, k = x.shape
    tiles = x.float().view(m, k // GROUP, GROUP)
    scale = (tiles.abs().amax(-1) / fp8.FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[..., None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    return q.view(m, k), scale


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def variants(w: fp8.Fp8Weight):
    """Candidate calls of the block-scaled GEMM: name -> fn(x_q, x_scale) -> bf16 [M, N]."""
    ST = F.ScalingType
    kb = w.scale.shape[1]
    s_pad4 = F.pad(w.scale, (0, -kb % 4)) if kb % 4 else w.scale

    def outer_major(t):  # column-major copy of a 2-d tensor
        return t.t().contiguous().t()

    def v1(xq, xs):  # weight column-major, activation scales outer-dim-major, weight scales [K/128, N/128]
        m = xq.shape[0]
        return F.scaled_mm(_pad_rows(xq, 4), w.data.t(), outer_major(_pad_rows(xs, 4)), ST.BlockWise1x128,
                           s_pad4.t(), ST.BlockWise128x128, output_dtype=torch.bfloat16)[:m]

    def v2(xq, xs):  # as v1 with the weight scales contiguous [K/128, N/128]
        m = xq.shape[0]
        return F.scaled_mm(_pad_rows(xq, 4), w.data.t(), outer_major(_pad_rows(xs, 4)), ST.BlockWise1x128,
                           w.scale.t().contiguous(), ST.BlockWise128x128, output_dtype=torch.bfloat16)[:m]

    def v3(xq, xs):  # the older entry point with the same layouts
        m = xq.shape[0]
        return torch._scaled_mm(_pad_rows(xq, 4), w.data.t(), scale_a=outer_major(_pad_rows(xs, 4)),
                                scale_b=s_pad4.t(), out_dtype=torch.bfloat16)[:m]

    return {"scaled_mm, scales [K/128, N/128] padded to 4 (view)": v1,
            "scaled_mm, scales [K/128, N/128] contiguous": v2,
            "_scaled_mm, scales as v1": v3}


def timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after three unmeasured ones (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times), 4)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


@torch.no_grad()
def probe(rows: list[int], iters: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    out = {"shapes": []}
    chosen = None
    for name, n, k in SHAPES:
        w_bf16 = (torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16)
        w = fp8.quantize_blocks(w_bf16)
        w_ref = w.dequantize(torch.float32)
        cands = variants(w)
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.float() @ w_ref.t()
            row = {"shape": name, "N": n, "K": k, "M": m,
                   "bf16_ms": timed(lambda: x @ w_bf16.t(), iters),
                   "engine_fp8_ms": timed(lambda: fp8.linear(x, w, fast=True), iters),
                   "engine_fp8_err": rel_err(fp8.linear(x, w, fast=True), ref)}
            xq, xs = quantize_rows(x)
            row["quantize_ms"] = timed(lambda: quantize_rows(x), iters)
            errors = {}
            for vname, fn in cands.items():
                if chosen is not None and vname != chosen:
                    continue
                try:
                    y = fn(xq, xs)
                    err = rel_err(y, ref)
                    if not err < 0.05:  # a wrong layout gives garbage, the right one FP8 rounding (~1e-2)
                        raise ValueError(f"relative error {err:.3g}")
                except Exception as exc:  # noqa: BLE001 - reported: which layouts this torch and GPU take
                    errors[vname] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                chosen = vname
                row.update(scaled_variant=vname, scaled_err=err, scaled_gemm_ms=timed(lambda: fn(xq, xs), iters),
                           scaled_total_ms=timed(lambda: fn(*quantize_rows(x)), iters))
                break
            if errors:
                row["scaled_errors"] = errors
            out["shapes"].append(row)
            print(json.dumps(row), flush=True)
    out["scaled_variant"] = chosen
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_gemm_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    res = probe(args.rows, args.iters)
    report = {"bench": "fp8_gemm_probe", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "python": platform.python_version(),
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "seconds": round(time.time() - t0, 1),
              **res}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nscaled GEMM layout: {res['scaled_variant']}")
    print("| projection | M | bf16 ms | engine FP8 ms (err) | scaled GEMM ms | + quantise ms (err) |")
    print("|---|---|---|---|---|---|")
    for r in res["shapes"]:
        scaled = (f"{r['scaled_gemm_ms']} | {r['scaled_total_ms']} ({r['scaled_err']:.1e})" if "scaled_gemm_ms" in r
                  else "failed | -")
        print(f"| {r['shape']} {r['N']}x{r['K']} | {r['M']} | {r['bf16_ms']} | {r['engine_fp8_ms']} "
              f"({r['engine_fp8_err']:.1e}) | {scaled} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
