"""Where a batch-1 decode step's time goes, and whether the Triton GEMV (qwen_chat.engine.model.gemv) beats cuBLAS.

Usage (one GPU host, repository root):  python bench/gemv_probe.py [--out DIR] [--quick]

1. Bandwidth: device-to-device copy (bytes read + written) and a read-only reduction (torch.sum), 2 GiB.
2. Every decode projection shape of the full Qwen3.5-9B config (bench/qwen3_5_9b_config.json) at B = 1, 2, 4,
   8, 16 rows: ``F.linear`` (cuBLAS) against the Triton kernels over a sweep of tile sizes.  Each timing replays
   a CUDA graph of calls that rotate over enough weight copies (>= 256 MiB) that the 50 MiB L2 cannot serve them;
   GB/s = weight bytes / time.  Also the error of each against an fp32 reference.
3. The engine's decode step (random bf16 weights, full config), with cuBLAS and with the Triton GEMV: graph
   replays back to back (GPU time per step), replay + synchronise per step, and ``runner.decode`` +
   ``sampler.sample`` per step (what the scheduler calls), plus a kernel profile.
Writes <out>/<date>-<gpu>-gemv-probe.json and prints a table last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen_chat.engine.model import gemv  # noqa: E402

SHAPES = {  # name: (N, K), full config, one GPU
    "gdn_in_proj(qkv+z+b+a)": (12352, 4096), "attn_qkv": (10240, 4096), "out_proj/o_proj": (4096, 4096),
    "mlp_gate_up": (24576, 4096), "mlp_down": (4096, 12288), "lm_head": (248320, 4096),
}


def graph_time(fn_list, reps: int = 20) -> float:
    """Seconds per call of the list of zero-argument callables, captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_list:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps / len(fn_list))
    return statistics.median(times)


def bandwidth(nbytes: int = 2 << 30) -> dict:
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.int16, device="cuda").view(torch.bfloat16)
    dst = torch.empty_like(src)
    out = torch.empty((), dtype=torch.float32, device="cuda")
    t_copy = graph_time([lambda: dst.copy_(src)], reps=5)
    t_read = graph_time([lambda: out.copy_(src.sum(dtype=torch.float32))], reps=5)
    return {"copy_gb_s": 2 * nbytes / t_copy / 1e9, "read_gb_s": nbytes / t_read / 1e9}


def row_configs():
    for bn, bk, nw, ns in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (3,)):
        if bn * bk <= 8192 and bn * bk >= 1024:
            yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)


def dot_configs():
    for bn, bk, nw, ns in itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 5)):
        if bn * bk <= 16384:
            yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)


def sweep_shape(name, N, K, batches, quick) -> dict:
    nbytes = N * K * 2
    copies = max(1, -(-(256 << 20) // nbytes))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    res = {"N": N, "K": K, "weight_mb": nbytes / 2**20, "copies": copies, "by_batch": {}}
    for B in batches:
        x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ ws[0].float().T
        row = {}
        outs = [torch.empty(B, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
        t = graph_time([lambda w=w: F.linear(x, w) for w in ws])
        row["cublas"] = {"us": t * 1e6, "gb_s": nbytes / t / 1e9,
                         "max_err": float((F.linear(x, ws[0]).float() - ref).abs().max())}
        if B == 1:
            t = graph_time([lambda w=w: torch.matmul(w, x.T) for w in ws])
            row["cublas_WxT"] = {"us": t * 1e6, "gb_s": nbytes / t / 1e9}
        best = None
        cfgs = list(row_configs() if B == 1 else dot_configs())
        if quick:
            cfgs = [gemv.pick_config(B, N, K)]
        for cfg in cfgs:
            if K % cfg["BLOCK_K"]:
                continue
            try:
                t = graph_time([lambda w=w, o=o: gemv.gemv(x, w, out=o, config=cfg) for w, o in zip(ws, outs)])
            except Exception as exc:  # a config Triton cannot compile (shared memory, registers)
                row.setdefault("failed", []).append(f"{cfg}: {type(exc).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        default = gemv.pick_config(B, N, K)
        t_def = graph_time([lambda w=w, o=o: gemv.gemv(x, w, out=o) for w, o in zip(ws, outs)])
        err = float((gemv.gemv(x, ws[0]).float() - ref).abs().max())
        row["triton_default"] = {"config": default, "us": t_def * 1e6, "gb_s": nbytes / t_def / 1e9, "max_err": err}
        if best:
            row["triton_best"] = {"config": best[1], "us": best[0] * 1e6, "gb_s": nbytes / best[0] / 1e9}
        res["by_batch"][str(B)] = row
        print(f"{name:26s} B={B:2d} cublas {row['cublas']['gb_s']:7.0f} GB/s  triton default "
              f"{row['triton_default']['gb_s']:7.0f}  best {row.get('triton_best', {}).get('gb_s', 0):7.0f} "
              f"{row.get('triton_best', {}).get('config')}", flush=True)
    del ws
    torch.cuda.empty_cache()
    return res


def engine_step(model, fast_gemv: bool, steps: int = 200) -> dict:
    """Decode-step timings of a runner with or without the Triton GEMV (batch 1, context bucket 512)."""
    from qwen_chat.engine.parallel.executors import LocalExecutor
    from qwen_chat.engine.types import PreparedPrompt, SamplingParams
    from qwen_chat.engine.model.options import RunnerOptions
    from qwen_chat.engine.model.runner import ModelRunner
    from qwen_chat.engine.model.sampling import Sampler
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT / "bench"))
    from decode_bench import decode_ahead

    t0 = time.perf_counter()
    runner = ModelRunner(model, num_slots=2, max_context=2048, device="cuda",
                         options=RunnerOptions(fast_gemv=fast_gemv))
    runner.capture_all(batch_sizes=[1], context_buckets=[512])
    sampler = Sampler(2, runner.vocab_size, "cuda")
    sampler.warm_up()
    capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    runner.prefill(0, PreparedPrompt(input_ids=torch.randint(0, 240000, (300,), generator=gen)))
    sampler.start(0, SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=1,
                                    max_new_tokens=10**6, stop_token_ids=()))
    tok = torch.tensor([5])
    for _ in range(3):
        runner.decode([0], tok)
    g = runner.graphs.decode_graph(1, 512)
    torch.cuda.synchronize()
    a = time.perf_counter()
    for _ in range(steps):
        g.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - a) / steps * 1e3
    a = time.perf_counter()
    for _ in range(steps):
        g.replay()
        torch.cuda.synchronize()
    replay_sync_ms = (time.perf_counter() - a) / steps * 1e3
    runner.lengths[0] = 300
    a = time.perf_counter()
    for _ in range(steps):
        tok = torch.tensor(sampler.sample([0], runner.decode([0], tok)))
    api_ms = (time.perf_counter() - a) / steps * 1e3
    runner.lengths[0] = 300
    torch.cuda.synchronize()
    a = time.perf_counter()
    decode_ahead(LocalExecutor(runner, sampler), [0], steps)
    pipelined_ms = (time.perf_counter() - a) / steps * 1e3
    runner.lengths[0] = 300
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            tok = torch.tensor(sampler.sample([0], runner.decode([0], tok)))
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) or 0.0
        if t > 0:
            rows.append((t / 10 / 1e3, e.count / 10, e.key[:100]))
    rows.sort(reverse=True)
    kern = [r for r in rows if not r[2].startswith(("cudaGraph", "Memcpy", "Memset", "aten::", "Cuda", "cuda"))]
    out = {"fast_gemv": fast_gemv, "capture_s": capture_s, "replay_ms": replay_ms,
           "replay_sync_ms": replay_sync_ms, "decode_sample_ms": api_ms, "pipelined_ms": pipelined_ms,
           "pipelined_tok_s": 1e3 / pipelined_ms,
           "decode_sample_tok_s": 1e3 / api_ms, "impl": runner.impl,
           "kernel_ms_per_step": sum(r[0] for r in kern), "kernels_per_step": sum(r[1] for r in kern),
           "top": [{"name": n, "ms": t, "calls": c} for t, c, n in kern[:20]]}
    del runner, sampler
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quick", action="store_true", help="default tile sizes only (no sweep)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-shapes", action="store_true", help="no per-shape GEMV sweep")
    ap.add_argument("--engine-modes", default="cublas,triton", help="runners to time: cublas, triton")
    args = ap.parse_args(argv)
    import transformers
    import triton

    gpu = torch.cuda.get_device_name().replace(" ", "-")
    doc = {"env": {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
                   "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                   "transformers": transformers.__version__,
                   "command": " ".join(["python", "bench/gemv_probe.py"] + (argv or sys.argv[1:]))},
           "errors": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{dt.date.today().isoformat()}-{gpu}-gemv-probe.json"

    def save():
        path.write_text(json.dumps(doc, indent=1))

    doc["bandwidth"] = bandwidth()
    print("bandwidth", doc["bandwidth"], flush=True)
    doc["shapes"] = {}
    for name, (N, K) in ({} if args.skip_shapes else SHAPES).items():
        try:
            doc["shapes"][name] = sweep_shape(name, N, K, (1, 2, 4, 8, 16), args.quick)
        except Exception:
            doc["errors"][name] = traceback.format_exc()
            print(doc["errors"][name], flush=True)
        save()
    if not args.skip_engine:
        sys.path.insert(0, str(ROOT / "bench"))
        from decode_bench import build_config
        from transformers import Qwen3_5ForConditionalGeneration

        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = Qwen3_5ForConditionalGeneration(build_config(False)).eval()
        torch.set_default_dtype(torch.float32)
        modes = args.engine_modes.split(",")
        for fast in [f for f, m in ((False, "cublas"), (True, "triton")) if m in modes]:
            try:
                doc[f"engine_fast_gemv_{fast}"] = engine_step(model, fast)
            except Exception:
                doc["errors"][f"engine_{fast}"] = traceback.format_exc()
                print(doc["errors"][f"engine_{fast}"], flush=True)
            save()
    # table
    print("\n| shape | B | cuBLAS GB/s | Triton default GB/s | Triton best GB/s | best config |")
    print("|---|---|---|---|---|---|")
    for name, r in doc["shapes"].items():
        for B, row in r["by_batch"].items():
            tb = row.get("triton_best", {})
            print(f"| {name} | {B} | {row['cublas']['gb_s']:.0f} | {row['triton_default']['gb_s']:.0f} | "
                  f"{tb.get('gb_s', 0):.0f} | {tb.get('config')} |")
    for fast in (False, True):
        e = doc.get(f"engine_fast_gemv_{fast}")
        if e:
            print(f"engine fast_gemv={fast}: replay {e['replay_ms']:.3f} ms, replay+sync {e['replay_sync_ms']:.3f}"
                  f" ms, decode+sample {e['decode_sample_ms']:.3f} ms ({e['decode_sample_tok_s']:.1f} tok/s), "
                  f"launched ahead {e['pipelined_ms']:.3f} ms ({e['pipelined_tok_s']:.1f} tok/s), "
                  f"kernels {e['kernel_ms_per_step']:.3f} ms in {e['kernels_per_step']:.0f}")
            for t in e["top"][:8]:
                print(f"    {t['ms']:.3f} ms x{t['calls']:.0f} {t['name']}")
    print("bandwidth", doc["bandwidth"], "errors:", list(doc["errors"]))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
