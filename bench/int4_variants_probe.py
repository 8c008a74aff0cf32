"""W4A16 kernel variants on the 9B's decode shapes (one GPU): which way of unpacking 4-bit weights is fastest.

    OUT=DIR python3 bench/int4_variants_probe.py [BUDGET_S]     # about 2 minutes on an H200

Variants (each checked against x @ dequantised(w)^T in fp32, relative error < 8e-3, before it is timed):
``_row_v2`` (one row; [BLOCK_N, G, 16, 8] unpacking with reshapes), ``_row_v3`` (one row; value j of every word in
turn, 2^23 bit trick: what ``int4_gemv._int4_row_kernel`` became), ``_dot_v2`` / ``_dot_v3`` (2-64 rows; bf16
128 + q bit trick on a reshaped tile / on strided input columns), ``_dot_v4`` (the input split into the eight
column sets 8w + j by register shuffles: what ``int4_gemv._int4_split_kernel`` became).  Times are per call in a
CUDA graph rotating >= 256 MiB of weights (L2 cannot serve them), next to cuBLAS on the bf16 weight.  Prints one
line per (shape, rows): the fastest variant and tile; writes DIR/int4_v2.json with every candidate's time
(recorded: bench/results/2026-12-02-NVIDIA-H200-int4-tiles.json).
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from gemv_probe import graph_time  # noqa: E402  (CUDA-graph timing shared with the other GEMV probes)

GROUP = 128


@triton.jit
def _row_v2(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    n_mask = offs_n < N
    KW: tl.constexpr = K // 8
    KG: tl.constexpr = K // 128
    offs_g = tl.arange(0, G)
    offs_w = tl.arange(0, 16)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    rows = offs_n.to(tl.int64)
    for g0 in range(0, KG, G):
        wp = p_ptr + rows[:, None, None] * KW + (g0 + offs_g)[None, :, None] * 16 + offs_w[None, None, :]
        words = tl.load(wp, mask=n_mask[:, None, None], other=0, eviction_policy="evict_first")  # [BN, G, 16]
        bits = ((words[:, :, :, None] >> shifts[None, None, None, :]) & 15) | 0x4B000000
        qf = bits.to(tl.float32, bitcast=True)  # 2^23 + q, exact
        meta = rows[:, None] * KG + g0 + offs_g[None, :]
        z = tl.load(z_ptr + meta, mask=n_mask[:, None], other=0).to(tl.float32) + 8388608.0  # [BN, G]
        xo = (g0 + offs_g)[:, None, None] * 128 + offs_w[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        x = tl.load(x_ptr + row * K + xo).to(tl.float32)  # [G, 16, 8]
        d = (qf - z[:, :, None, None]) * x[None, :, :, :]
        part = tl.sum(tl.sum(d, axis=3), axis=2)  # [BN, G]
        s = tl.load(s_ptr + meta, mask=n_mask[:, None], other=0.0)
        acc += part * s
    tl.store(y_ptr + row * N + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dot_v2(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, B, N, K: tl.constexpr, BLOCK_B: tl.constexpr,
            BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    n_mask = offs_n < N
    b_mask = offs_b[:, None] < B
    KW: tl.constexpr = K // 8
    KG: tl.constexpr = K // 128
    rows = offs_n.to(tl.int64)
    offs_w = tl.arange(0, 16)
    shifts = tl.arange(0, 8) * 4
    x_ptrs = x_ptr + offs_b[:, None].to(tl.int64) * K + tl.arange(0, 128)[None, :]
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for g in range(0, KG):
        words = tl.load(p_ptr + rows[:, None] * KW + g * 16 + offs_w[None, :], mask=n_mask[:, None], other=0,
                        eviction_policy="evict_first")  # [BN, 16]
        q16 = (((words[:, :, None] >> shifts[None, None, :]) & 15) | 0x4300).to(tl.int16)
        wq = tl.reshape(q16.to(tl.bfloat16, bitcast=True), (BLOCK_N, 128))  # 128 + q, exact in bf16
        x = tl.load(x_ptrs + g * 128, mask=b_mask, other=0.0)  # [BB, 128]
        xb = x.to(tl.bfloat16)
        dotq = tl.dot(xb, tl.trans(wq))  # [BB, BN] = sum x (128 + q)
        xs = tl.sum(xb.to(tl.float32), axis=1)  # [BB]
        meta = rows * KG + g
        z = tl.load(z_ptr + meta, mask=n_mask, other=0).to(tl.float32) + 128.0
        s = tl.load(s_ptr + meta, mask=n_mask, other=0.0)
        acc += (dotq - xs[:, None] * z[None, :]) * s[None, :]
    out = y_ptr + offs_b[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=b_mask & n_mask[None, :])


@triton.jit
def _row_v3(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    n_mask = offs_n < N
    KW: tl.constexpr = K // 8
    KG: tl.constexpr = K // 128
    rows = offs_n.to(tl.int64)
    offs_kw = tl.arange(0, BKW)
    acc = tl.zeros((BLOCK_N, BKW), dtype=tl.float32)
    for kw0 in range(0, KW, BKW):
        words = tl.load(p_ptr + rows[:, None] * KW + kw0 + offs_kw[None, :], mask=n_mask[:, None], other=0,
                        eviction_policy="evict_first")  # [BN, BKW]
        meta = rows[:, None] * KG + (kw0 + offs_kw[None, :]) // 16
        z = tl.load(z_ptr + meta, mask=n_mask[:, None], other=0).to(tl.float32) + 8388608.0
        s = tl.load(s_ptr + meta, mask=n_mask[:, None], other=0.0)
        part = tl.zeros((BLOCK_N, BKW), dtype=tl.float32)
        for j in tl.static_range(8):
            qf = (((words >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True)
            xj = tl.load(x_ptr + row * K + (kw0 + offs_kw) * 8 + j).to(tl.float32)
            part += (qf - z) * xj[None, :]
        acc += part * s
    tl.store(y_ptr + row * N + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dot_v3(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, B, N, K: tl.constexpr, BLOCK_B: tl.constexpr,
            BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    n_mask = offs_n < N
    b_mask = offs_b[:, None] < B
    KW: tl.constexpr = K // 8
    KG: tl.constexpr = K // 128
    rows = offs_n.to(tl.int64)
    offs_w = tl.arange(0, 16)
    xrow = x_ptr + offs_b[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for g in range(0, KG):
        words = tl.load(p_ptr + rows[:, None] * KW + g * 16 + offs_w[None, :], mask=n_mask[:, None], other=0,
                        eviction_policy="evict_first")  # [BN, 16]
        part = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BLOCK_B,), dtype=tl.float32)
        for j in tl.static_range(8):
            wj = (((words >> (4 * j)) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
            xj = tl.load(xrow + g * 128 + offs_w[None, :] * 8 + j, mask=b_mask, other=0.0).to(tl.bfloat16)
            part += tl.dot(xj, tl.trans(wj))
            xs += tl.sum(xj.to(tl.float32), axis=1)
        meta = rows * KG + g
        z = tl.load(z_ptr + meta, mask=n_mask, other=0).to(tl.float32) + 128.0
        sc = tl.load(s_ptr + meta, mask=n_mask, other=0.0)
        acc += (part - xs[:, None] * z[None, :]) * sc[None, :]
    out = y_ptr + offs_b[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=b_mask & n_mask[None, :])


@triton.jit
def _dot_v4(x_ptr, p_ptr, s_ptr, z_ptr, y_ptr, B, N, K: tl.constexpr, BLOCK_B: tl.constexpr,
            BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    n_mask = offs_n < N
    b_mask = offs_b[:, None] < B
    KW: tl.constexpr = K // 8
    KG: tl.constexpr = K // 128
    rows = offs_n.to(tl.int64)
    offs_w = tl.arange(0, 16)
    x_ptrs = x_ptr + offs_b[:, None].to(tl.int64) * K + tl.arange(0, 128)[None, :]
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for g in range(0, KG):
        words = tl.load(p_ptr + rows[:, None] * KW + g * 16 + offs_w[None, :], mask=n_mask[:, None], other=0,
                        eviction_policy="evict_first")  # [BN, 16]
        x = tl.load(x_ptrs + g * 128, mask=b_mask, other=0.0).to(tl.bfloat16)  # [BB, 128]
        xs = tl.sum(x.to(tl.float32), axis=1)
        x8 = tl.reshape(x, (BLOCK_B, 16, 2, 2, 2))
        e0, o0 = tl.split(x8)          # j0 = 0 / 1: [BB, 16, 2, 2]
        e00, e01 = tl.split(e0)        # j1
        o00, o01 = tl.split(o0)
        x0, x4 = tl.split(e00)         # j2: j = 4*j2 + 2*j1 + j0
        x2, x6 = tl.split(e01)
        x1, x5 = tl.split(o00)
        x3, x7 = tl.split(o01)
        part = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
        part += tl.dot(x0, tl.trans(((words & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        part += tl.dot(x1, tl.trans((((words >> 4) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        part += tl.dot(x2, tl.trans((((words >> 8) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        part += tl.dot(x3, tl.trans((((words >> 12) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        part += tl.dot(x4, tl.trans((((words >> 16) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        part += tl.dot(x5, tl.trans((((words >> 20) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        part += tl.dot(x6, tl.trans((((words >> 24) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        part += tl.dot(x7, tl.trans((((words >> 28) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)))
        meta = rows * KG + g
        z = tl.load(z_ptr + meta, mask=n_mask, other=0).to(tl.float32) + 128.0
        sc = tl.load(s_ptr + meta, mask=n_mask, other=0.0)
        acc += (part - xs[:, None] * z[None, :]) * sc[None, :]
    out = y_ptr + offs_b[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=b_mask & n_mask[None, :])


def pack(q):
    n, k = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (q.to(torch.int32).view(n, k // 8, 8) << shifts).sum(dim=-1, dtype=torch.int32)


SHAPES = {"mlp_gate_up": (24576, 4096), "mlp_down": (4096, 12288), "gdn_in_proj": (12288, 4096),
          "o_proj": (4096, 4096), "attn_qkv": (10240, 4096)}


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    dev = "cuda"
    torch.manual_seed(0)
    results = {}
    t_start = time.time()
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 400
    for name, (N, K) in SHAPES.items():
        q = torch.randint(0, 16, (N, K), dtype=torch.int32, device=dev)
        packed = pack(q)
        scale = (torch.rand(N, K // GROUP, device=dev) * 0.02 + 0.001).float()
        zero = torch.randint(0, 16, (N, K // GROUP), dtype=torch.uint8, device=dev)
        w = ((q.view(N, K // GROUP, GROUP).float() - zero.float()[:, :, None]) * scale[:, :, None]).view(N, K)
        nbytes = packed.numel() * 4 + scale.numel() * 4 + zero.numel()
        copies = max(1, (256 << 20) // nbytes + 1)
        ws = [(packed.clone(), scale.clone(), zero.clone()) for _ in range(copies)]
        wbf = w.to(torch.bfloat16)
        bf_copies = [wbf.clone() for _ in range(max(1, (256 << 20) // (wbf.numel() * 2) + 1))]
        res = {}
        for B in (1, 4, 16, 32, 64):
            if time.time() - t_start > budget:
                break
            x = torch.randn(B, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w.t()
            y = torch.empty(B, N, device=dev, dtype=torch.bfloat16)
            ybf = torch.empty(B, N, device=dev, dtype=torch.bfloat16)
            t_bf = graph_time([lambda wb=wb: torch.matmul(x, wb.t(), out=ybf) for wb in bf_copies])
            cands = []
            if B == 1:
                for bn, bkw, nw, ns in itertools.product((4, 8, 16), (64, 128), (4, 8), (1, 2, 3)):
                    cands.append(("row3", dict(BLOCK_N=bn, BKW=bkw, num_warps=nw, num_stages=ns)))
            else:
                bb = 16 if B <= 16 else B
                for kind, bn, nw, ns in itertools.product(("dot3", "dot4"), (32, 64, 128), (4,), (3, 4)):
                    cands.append((kind, dict(BLOCK_B=bb, BLOCK_N=bn, num_warps=nw, num_stages=ns)))
                cands.append(("dot", dict(BLOCK_B=bb, BLOCK_N=128, num_warps=4, num_stages=4)))
            best = None
            allt = []
            for kind, cfg in cands:
                try:
                    if kind.startswith("row"):
                        kr = _row_v3 if kind == "row3" else _row_v2

                        def run(p, s_, z_, cfg=cfg, kr=kr):
                            kr[(triton.cdiv(N, cfg["BLOCK_N"]), B)](x, p, s_, z_, y, N, K, **cfg)
                    else:
                        kd = {"dot3": _dot_v3, "dot4": _dot_v4}.get(kind, _dot_v2)

                        def run(p, s_, z_, cfg=cfg, kd=kd):
                            kd[(triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(B, cfg["BLOCK_B"]))](
                                x, p, s_, z_, y, B, N, K, **cfg)
                    run(packed, scale, zero)
                    torch.cuda.synchronize()
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 8e-3:
                        print(f"{name} B={B} {kind} {cfg}: err {err:.2e}", flush=True)
                        continue
                    t = graph_time([lambda p=p, s_=s_, z_=z_: run(p, s_, z_) for p, s_, z_ in ws], reps=10)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} B={B} {kind} {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    continue
                allt.append((kind, cfg, t * 1e6))
                if best is None or t < best[0]:
                    best = (t, kind, cfg, err)
            if best:
                res[B] = {"us": best[0] * 1e6, "kind": best[1], "config": best[2], "err": best[3],
                          "gb_s": nbytes / best[0] / 1e9, "bf16_cublas_us": t_bf * 1e6, "all": allt}
                print(f"{name:12s} B={B:2d} int4 {best[0]*1e6:7.1f} us ({nbytes/best[0]/1e9:6.0f} GB/s) "
                      f"{best[1]} {best[2]} err {best[3]:.1e} | bf16 cuBLAS {t_bf*1e6:6.1f} us", flush=True)
        results[name] = res
        with open(os.path.join(out_dir, "int4_v2.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
