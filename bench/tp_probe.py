"""Tensor-parallel decode on one host: where a TP=2 batch-1 step's time goes, against one GPU, in one run.

Usage (a 2-GPU host, repository root; what produced bench/results/*-tp-probe*.json):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --standalone --nproc_per_node 2 bench/tp_probe.py --out DIR [--steps 200]

Model: the full published config (bench/qwen3_5_9b_config.json), random bf16 weights, built on every GPU with
the same seed.  Sections (every timing is measured, printed and written to <out>/<date>-<gpu>-tp-probe.json):

1. ``allreduce``: one hidden row per decode row (1, 4, 16, 32 x 4,096 bf16) summed over the two GPUs, 64 calls
   captured in one CUDA graph: ``torch.distributed`` (NCCL) against ``collectives.TensorParallelComm`` with
   symmetric memory; us per call and whether both give the same sum.
2. ``single``: rank 0 alone, the unsharded model, as the service runs one GPU (Triton GEMV, CUDA graphs):
   graph replay back to back, and decode launched ahead through ``LocalExecutor`` (tok/s).  Meanwhile rank 1
   sweeps the Triton GEMV tile sizes for the TP=2 projection shapes (``gemv_probe.sweep_shape``, B = 1).
3. ``tp_<kind>``: the model sharded as the service shards it (``sharding.shard_model`` with ds_config.json),
   one runner per all-reduce kind: replay back to back; replay + wait; decode launched ahead on both ranks
   (``LocalExecutor``); through ``executors.DistributedExecutor`` + ``worker_loop`` as the service runs, launched
   ahead and waited for each step; batches 4 and 16 launched ahead; and rank 0's top GPU kernels per step.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from qwen_chat.engine.parallel import ranks as qdist  # noqa: E402
from qwen_chat.engine.parallel.collectives import TensorParallelComm, broadcast_from_rank0  # noqa: E402
from qwen_chat.engine.parallel.executors import DistributedExecutor, LocalExecutor, worker_loop  # noqa: E402
from qwen_chat.engine.types import PrefillItem, PreparedPrompt, SamplingParams, StepPlan  # noqa: E402

#: TP=2 decode projection shapes of the full config, per rank: (N, K).
TP2_SHAPES = {"gdn_in_proj/2": (6176, 4096), "attn_qkv/2": (5120, 4096), "out_proj/o_proj/2": (4096, 2048),
              "mlp_gate_up/2": (12288, 4096), "mlp_down/2": (4096, 6144), "lm_head/2": (124160, 4096)}
PARAMS = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
#: Set to "0" by bench/tp_probe.sh when the 2-GPU test of the fused kernels failed: the TP runners then run
#: without them (the service's ``--no-tp-fused``).
FUSED_ENV = "QWEN_CHAT_TP_FUSED"


def fused_kernels() -> bool:
    """Whether the TP comms of this probe offer the fused kernels (not when ``FUSED_ENV`` is "0")."""
    return os.environ.get(FUSED_ENV, "1").strip() != "0"


def graph_us(fn, calls: int = 64, reps: int = 20) -> float:
    """us per call of ``fn`` captured ``calls`` times in one CUDA graph (median of 5 timings; the ranks meet at a
    barrier before each timing when torch.distributed is initialised)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        a = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - a) / reps / calls * 1e6)
    return sorted(times)[2]


def allreduce_section(device) -> dict:
    out = {}
    comm = TensorParallelComm(None, device, torch.bfloat16, backend="symm_mem", fused=fused_kernels())
    for rows in (1, 4, 16, 32):
        torch.manual_seed(dist.get_rank() + 10 * rows)
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        ref = x.clone()
        dist.all_reduce(ref)
        got = comm.all_reduce(x.clone())
        y = x.clone()
        nccl = graph_us(lambda: dist.all_reduce(y))
        symm = graph_us(lambda: comm.all_reduce(x))
        out[str(rows)] = {"nccl_us": nccl, "symm_mem_us": symm, "same_sum": bool(torch.equal(ref, got))}
    return out


def build_model(device):
    from decode_bench import build_config
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForConditionalGeneration(build_config(False))
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def prefill(ex: LocalExecutor, slots, prompt_len: int = 300) -> None:
    gen = torch.Generator().manual_seed(5)
    for s in slots:
        ids = torch.randint(0, 240000, (prompt_len,), generator=gen)
        sp = SamplingParams(seed=100 + s, max_new_tokens=10**6, stop_token_ids=(), **PARAMS)
        ex.execute(StepPlan(free_slots=[s], prefills=[PrefillItem(s, PreparedPrompt(input_ids=ids), sp)]))


GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=1, presence_penalty=0.0, seed=0, max_new_tokens=10**6,
                        stop_token_ids=())


def greedy(ex: LocalExecutor, n_prompts: int = 4, new: int = 32) -> dict:
    """Greedy tokens (``new`` per prompt) and the fp32 prefill logits [V] of ``n_prompts`` random prompts."""
    gen = torch.Generator().manual_seed(11)
    tokens, logits = [], []
    for p in range(n_prompts):
        prompt = PreparedPrompt(input_ids=torch.randint(0, 240000, (64 + 96 * p,), generator=gen))
        logits.append(ex.runner.prefill(0, prompt).clone())
        ex.runner.free(0)
        toks = [ex.execute(StepPlan(free_slots=[0], prefills=[PrefillItem(0, prompt, GREEDY)]))[0]]
        for _ in range(new - 1):
            toks.append(ex.execute(StepPlan(decode_slots=[0], decode_tokens=[toks[-1]]))[0])
        ex.execute(StepPlan(free_slots=[0]))
        tokens.append(toks)
    return {"tokens": tokens, "logits": logits}


def compare_greedy(ref: dict, got: dict) -> dict:
    """Agreement of greedy runs: per prompt the first differing position (len if none), the share of equal
    positions, and the prefill logits' max abs difference and top-1 equality."""
    rows = []
    for rt, gt, rl, gl in zip(ref["tokens"], got["tokens"], ref["logits"], got["logits"]):
        first = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), len(rt))
        rows.append({"first_difference": first, "equal_share": sum(a == b for a, b in zip(rt, gt)) / len(rt),
                     "prefill_logits_max_abs_diff": float((rl - gl).abs().max()),
                     "prefill_logits_ref_absmax": float(rl.abs().max()),
                     "prefill_top1_equal": int(rl.argmax()) == int(gl.argmax())})
    return {"prompts": rows, "mean_first_difference": sum(r["first_difference"] for r in rows) / len(rows)}


REFERENCE: dict = {}


def ahead_tok_s(executor, slots, steps: int) -> float:
    """Aggregate tok/s of ``steps`` decode steps of ``slots`` launched one ahead (decode_bench.decode_ahead)."""
    from decode_bench import decode_ahead

    torch.cuda.synchronize()
    a = time.perf_counter()
    decode_ahead(executor, list(slots), steps)
    torch.cuda.synchronize()
    return len(slots) * steps / (time.perf_counter() - a)


def scheduler_tok_s(executor, runner, steps: int, repeats: int = 3) -> list:
    """Batch-1 decode as the service runs it: one request at a time through the rank-0 ``Scheduler`` (steps
    launched ahead when the executor shares tokens on the device) -> decode tok/s per request = (tokens - 1) /
    (time of the last token - time of the first)."""
    from qwen_chat.chat_types import CancelToken
    from qwen_chat.engine.core.scheduler import Scheduler

    sched = Scheduler(executor, num_slots=runner.num_slots, max_queue=4, eos_ids=(), max_context=runner.max_context,
                      overlap=bool(getattr(executor, "tokens_on_device", True)), num_blocks=runner.num_blocks,
                      block_tokens=runner.block_tokens)
    out = []
    try:
        gen = torch.Generator().manual_seed(9)
        for r in range(repeats):
            prompt = PreparedPrompt(input_ids=torch.randint(0, 240000, (300,), generator=gen), max_new_tokens=steps)
            params = SamplingParams(seed=r, max_new_tokens=steps, stop_token_ids=(), **PARAMS)
            stamps = [time.perf_counter() for _ in sched.submit(prompt, params, CancelToken())]
            out.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    finally:
        sched.shutdown()
    return out


def replay_ms(runner, steps: int, sync_each: bool) -> float:
    g = runner.graphs.decode_graph(1, 512)
    torch.cuda.synchronize()
    a = time.perf_counter()
    for _ in range(steps):
        g.replay()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - a) / steps * 1e3


def top_kernels(runner, steps: int = 20, batch: int = 1) -> dict:
    from torch.profiler import ProfilerActivity, profile

    g = runner.graphs.decode_graph(batch, 512)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0.0) or 0.0
        if t > 0 and not e.key.startswith(("cudaGraph", "Memcpy", "Memset")):
            rows.append((t / steps / 1e3, e.count / steps, e.key[:110]))
    rows.sort(reverse=True)
    return {"kernel_ms_per_step": sum(r[0] for r in rows), "kernels_per_step": sum(r[1] for r in rows),
            "top": [{"ms": t, "calls": c, "name": n} for t, c, n in rows[:25]]}


def make_runner(model, device, kind, batches):
    """A runner (16 slots, graphs for ``batches`` at context 512) and its sampler; ``kind``: the TP all-reduce
    kind (``RunnerOptions.tp_allreduce``; the fused kernels as ``fused_kernels()``), or None for one GPU."""
    from qwen_chat.engine.model.options import RunnerOptions
    from qwen_chat.engine.model.runner import ModelRunner
    from qwen_chat.engine.model.sampling import Sampler

    t0 = time.perf_counter()
    options = RunnerOptions(tp_allreduce=kind or "auto", tp_fused=fused_kernels())
    runner = ModelRunner(model, num_slots=16, max_context=2048, device=device, options=options)
    runner.capture_all(batch_sizes=batches, context_buckets=[512])
    sampler = Sampler(16, runner.vocab_size, device)
    if kind is not None:
        sampler.token_sync = broadcast_from_rank0
    sampler.warm_up()
    return runner, sampler, time.perf_counter() - t0


def single_section(model, device, steps: int) -> dict:
    runner, sampler, setup_s = make_runner(model, device, None, [1])
    ex = LocalExecutor(runner, sampler)
    prefill(ex, [0])
    res = {"setup_s": setup_s, "impl": runner.impl, "replay_ms": replay_ms(runner, steps, False),
           "replay_sync_ms": replay_ms(runner, steps, True)}
    runner.lengths[0] = 300
    res["ahead_tok_s"] = ahead_tok_s(ex, [0], steps)
    runner.lengths[0] = 300
    res["ahead_tok_s_2"] = ahead_tok_s(ex, [0], steps)
    res["profile"] = top_kernels(runner)
    res["scheduler"] = scheduler_tok_s(ex, runner, steps)
    REFERENCE.update(greedy(ex))
    return res


def tp_section(model, device, kind: str, groups, steps: int) -> dict:
    runner, sampler, setup_s = make_runner(model, device, kind, [1, 4, 16])
    ex = LocalExecutor(runner, sampler)
    prefill(ex, range(16))
    res = {"setup_s": setup_s, "impl": runner.impl}
    runner.lengths[0] = 300
    res["replay_ms"] = replay_ms(runner, steps, False)
    res["replay_sync_ms"] = replay_ms(runner, steps, True)
    for b in (1, 4, 16):
        for s in range(b):
            runner.lengths[s] = 300
        res[f"local_ahead_b{b}_tok_s"] = ahead_tok_s(ex, range(b), steps if b == 1 else steps // 2)
    runner.lengths[0] = 300
    tok = ex.execute(StepPlan(decode_slots=[0], tokens_on_device=True))[0]
    torch.cuda.synchronize()
    a = time.perf_counter()
    for _ in range(steps // 2):
        tok = ex.execute(StepPlan(decode_slots=[0], decode_tokens=[tok]))[0]
    res["local_waited_tok_s"] = (steps // 2) / (time.perf_counter() - a)
    res["local_ahead_tok_s"] = res["local_ahead_b1_tok_s"]
    res["profile"] = top_kernels(runner)
    for s in range(16):
        runner.lengths[s] = 300
    res["profile_b16"] = top_kernels(runner, batch=16)
    run = greedy(ex)
    if REFERENCE:
        res["greedy_vs_single"] = compare_greedy(REFERENCE, run)
    prefill(ex, [0])  # greedy() freed slot 0
    # as the service runs it: rank 0 broadcasts each plan over gloo, rank 1 runs worker_loop
    runner.lengths[0] = 300
    dist.barrier()
    if dist.get_rank() == 0:
        dex = DistributedExecutor(ex, groups.control, 600.0)
        res["service_ahead_tok_s"] = ahead_tok_s(dex, [0], steps)
        tok = dex.execute(StepPlan(decode_slots=[0], tokens_on_device=True))[0]
        torch.cuda.synchronize()
        a = time.perf_counter()
        for _ in range(steps):
            tok = dex.execute(StepPlan(decode_slots=[0], decode_tokens=[tok]))[0]
        res["service_waited_tok_s"] = steps / (time.perf_counter() - a)
        res["scheduler"] = scheduler_tok_s(dex, runner, steps)
        dex.close()
    else:
        worker_loop(ex, groups.control)
    del runner, sampler, ex
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kinds", default="nccl,symm_mem")
    ap.add_argument("--skip-shapes", action="store_true", help="no GEMV tile sweep of the TP=2 shapes on rank 1")
    args = ap.parse_args(argv)
    info = qdist.RankInfo.from_env()
    device = torch.device("cuda", info.local_rank)
    torch.cuda.set_device(device)
    groups = qdist.init_process_groups(info, device, 600.0)
    rank = info.rank
    import transformers
    import triton

    doc = {"env": {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                   "gpu": torch.cuda.get_device_name(), "world_size": info.world_size, "torch": torch.__version__,
                   "triton": triton.__version__, "cuda": torch.version.cuda,
                   "transformers": transformers.__version__,
                   "command": "torchrun --standalone --nproc_per_node 2 bench/tp_probe.py " + " ".join(sys.argv[1:])},
           "errors": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{dt.date.today().isoformat()}-{doc['env']['gpu'].replace(' ', '-')}-tp-probe.json"

    def section(name, fn):
        t0 = time.perf_counter()
        try:
            doc[name] = fn()
        except Exception:  # noqa: BLE001 - keep the other sections
            doc["errors"][name] = traceback.format_exc()
            print(f"rank {rank}: {name} failed:\n{doc['errors'][name]}", flush=True)
        print(f"rank {rank}: {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        if rank == 0:
            path.write_text(json.dumps(doc, indent=1))

    section("allreduce", lambda: allreduce_section(device))
    model = build_model(device)
    if rank == 0:
        section("single", lambda: single_section(model, device, args.steps))
    elif not args.skip_shapes:
        from gemv_probe import sweep_shape

        section("tp2_shapes", lambda: {n: sweep_shape(n, N, K, (1, 4), False) for n, (N, K) in TP2_SHAPES.items()})
    dist.barrier(group=groups.startup)
    if rank == 1:
        shapes = doc.get("tp2_shapes")
        box = [shapes]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=1, group=groups.startup)
    doc["tp2_shapes"] = box[0]
    from qwen_chat.engine.parallel import sharding

    plan = sharding.read_plan(ROOT / "ds_config.json", info.world_size, "cuda")
    model = sharding.shard_model(model, plan, device)
    torch.cuda.empty_cache()
    for kind in args.kinds.split(","):
        section(f"tp_{kind}", lambda kind=kind: tp_section(model, device, kind, groups, args.steps))
    if rank == 0:
        print("\n| section | metric | value |\n|---|---|---|")
        for rows, r in (doc.get("allreduce") or {}).items():
            print(f"| allreduce {rows}x4096 bf16 | NCCL / symm_mem us per call (same sum) | {r['nccl_us']:.1f} / "
                  f"{r['symm_mem_us']:.1f} ({r['same_sum']}) |")
        for name, r in (doc.get("tp2_shapes") or {}).items():
            for B, row in r["by_batch"].items():
                print(f"| gemv {name} B={B} | cuBLAS / triton default / best GB/s (best config) | "
                      f"{row['cublas']['gb_s']:.0f} / {row['triton_default']['gb_s']:.0f} / "
                      f"{row.get('triton_best', {}).get('gb_s', 0):.0f} ({row.get('triton_best', {}).get('config')}) |")
        for name in ["single"] + [f"tp_{k}" for k in args.kinds.split(",")]:
            r = doc.get(name)
            if not r:
                continue
            for key, value in r.items():
                if isinstance(value, float) and key != "setup_s":
                    print(f"| {name} | {key} | {value:.2f} |")
            if "impl" in r:
                print(f"| {name} | runner: tp_all_reduce, fused all-reduce + norm, GDN decode | "
                      f"{r['impl'].get('tp_all_reduce')}, {r['impl'].get('tp_fused_all_reduce_norm')}, "
                      f"{r['impl'].get('gdn_decode')} |")
            if "scheduler" in r:
                print(f"| {name} | through the Scheduler (service path), tok/s per request | "
                      f"{', '.join(f'{v:.1f}' for v in r['scheduler'])} |")
            if "greedy_vs_single" in r:
                rows = r["greedy_vs_single"]["prompts"]
                print(f"| {name} | greedy vs single: first difference per prompt (of 32); prefill top-1 equal | "
                      f"{[x['first_difference'] for x in rows]}; {[x['prefill_top1_equal'] for x in rows]} |")
            p = r.get("profile", {})
            print(f"| {name} | GPU kernels per step (ms, count) | {p.get('kernel_ms_per_step', 0):.3f}, "
                  f"{p.get('kernels_per_step', 0):.0f} |")
            for t in p.get("top", [])[:6]:
                print(f"| {name} | top kernel x{t['calls']:.0f} | {t['ms']:.3f} ms {t['name'][:80]} |")
            for t in r.get("profile_b16", {}).get("top", [])[:4]:
                print(f"| {name} | B=16 top kernel x{t['calls']:.0f} | {t['ms']:.3f} ms {t['name'][:80]} |")
        print("errors:", list(doc["errors"]))
        path.write_text(json.dumps(doc, indent=1))
    dist.barrier(group=groups.startup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
