"""Prefill benchmark of the engine alone (no HTTP; for kernel work, not a claim about the service): one prompt
chunk through the piecewise prefill CUDA graphs (``qwen_chat/engine/model/prefill_graph.py``) against the packed
eager prefill, on the full published Qwen3.5-9B config with random bf16 weights.

Usage (one GPU host, from the repository root):

    python bench/prefill_bench.py --out bench/results/<date>-<gpu>-prefill   # writes <out>.json, prints a table
    python bench/prefill_bench.py --smoke --out /tmp/p                        # tiny config on CPU: checks the script

Measures: the capture time and memory of the prefill graphs; per prompt length the prefill latency (prefill +
synchronise, median of 5 after a warm-up) through the graphs and eagerly (graph prefill switched off); a
follow-up turn (restore the state kept after a long history, then prefill 30 new tokens with a keep point, as the
conversation cache does) both ways; the GPU kernel time, kernel count and top kernels of a 1k prefill both ways
(torch profiler); agreement of the graph path with the eager path and of both with an fp32 copy of the model
(transformers' own forward): relative error of the last token's logits and whether the argmax agrees.
Every section is guarded: a failure is recorded and the run goes on.  The table is printed last.
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_bench import random_model, profile_prefill, random_ids, timed  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner  # noqa: E402
from qwen_chat.engine.types import PrefillItem, PreparedPrompt  # noqa: E402


def latency(runner, dev, prompt: PreparedPrompt, graphs: bool, repeats: int = 5) -> float:
    """Median ms of ``runner.prefill`` of ``prompt`` into slot 0 (after one warm-up run)."""
    held = runner.graph_prefill
    runner.graph_prefill = held if graphs else None
    try:
        def once():
            runner.free(0)
            return runner.prefill(0, prompt)

        once()
        times = [timed(once, dev)[0] for _ in range(repeats)]
    finally:
        runner.graph_prefill = held
        runner.free(0)
    return statistics.median(times) * 1e3


def follow_up(runner, dev, history: int, new: int, gen, graphs: bool, repeats: int = 5) -> float:
    """Median ms of a follow-up turn: restore the state kept after ``history`` tokens into slot 1 and prefill
    ``new`` tokens keeping the state 3 tokens before the end (the conversation cache's keep point)."""
    ids = random_ids(history + new, gen)
    prompt = PreparedPrompt(input_ids=ids)
    runner.free(3)
    runner.prefill_batch([PrefillItem(0, prompt, start=0, end=history, resume=True, keeps=((history, 3),))])
    runner.free(0)
    held = runner.graph_prefill
    runner.graph_prefill = held if graphs else None
    try:
        def once():
            runner.free(1)
            runner.free(2)
            runner.restore(3, 1)
            return runner.prefill_batch([PrefillItem(1, prompt, start=history, keeps=((history + new - 3, 2),))])

        once()
        times = [timed(once, dev)[0] for _ in range(repeats)]
    finally:
        runner.graph_prefill = held
        for s in (1, 2, 3):
            runner.free(s)
    return statistics.median(times) * 1e3


def kernels(runner, dev, prompt_len: int, gen, graphs: bool) -> dict:
    """GPU kernel ms, kernel launches and profiled wall ms of one prefill of ``prompt_len`` random tokens
    (``decode_bench.profile_prefill``), through the graphs or eagerly."""
    held = runner.graph_prefill
    runner.graph_prefill = held if graphs else None
    try:
        got = profile_prefill(runner, dev, prompt_len, gen)
    finally:
        runner.graph_prefill = held
    return {key: got[key] for key in ("gpu_kernel_ms", "kernels", "wall_ms_profiled", "top_gpu")}


def burst_steps(prompts: list, budget: int) -> list[list[PrefillItem]]:
    """The steps of a burst: each takes up to ``budget`` tokens, the cut prompt first in the next step."""
    steps, cur, left = [], [], budget
    for slot, p in enumerate(prompts):
        start = 0
        while start < p.num_tokens:
            take = min(p.num_tokens - start, left)
            cur.append(PrefillItem(slot, p, start=start, end=start + take))
            start += take
            left -= take
            if left == 0:
                steps.append(cur)
                cur, left = [], budget
    if cur:
        steps.append(cur)
    return steps


def burst_items(prompts: int, prompt_len: int, budget: int, gen) -> list:
    """The first step of a burst of ``prompts`` new prompts of ``prompt_len`` random tokens (``burst_steps``):
    slots 0.., the last prompt cut at ``budget`` tokens."""
    return burst_steps([PreparedPrompt(input_ids=random_ids(prompt_len, gen)) for _ in range(prompts)], budget)[0]


def packed_agreement(runners: dict, model, dev, gen, prompts=7, prompt_len=600, budget=4096) -> dict:
    """The 32-stream burst's packed step (7 prompts of 600 tokens in 4,096) through each runner in ``runners``
    (name -> runner), and each complete prompt through an fp32 copy of the model (transformers' forward):
    relative error of each complete prompt's last-token logits between the runners and against fp32 (worst of
    the prompts), and how many argmaxes agree with fp32."""
    items = burst_items(prompts, prompt_len, budget, gen)
    got = {}
    for name, r in runners.items():
        for c in items:
            r.free(c.slot)
        got[name] = r.prefill_batch(items).float()
        for c in items:
            r.free(c.slot)
    full = [c for c in items if c.stop() == c.prompt.num_tokens]
    ref_model = copy.deepcopy(model).float()
    try:
        with torch.no_grad():
            ref = torch.stack([ref_model(input_ids=c.prompt.input_ids[None].to(dev)).logits[0, -1].float()
                               for c in full])
    finally:
        del ref_model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    rel = lambda a, b: max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))  # noqa: E731
    names = list(got)
    out = {"prompts": len(full), f"{names[0]}_vs_{names[1]}": rel(got[names[0]], got[names[1]])}
    for name in names:
        out[f"{name}_vs_fp32"] = rel(got[name], ref)
        out[f"{name}_argmax_agree_fp32"] = int((got[name].argmax(-1) == ref.argmax(-1)).sum())
    return out


def packed_step(runner, dev, prompts: int, prompt_len: int, budget: int, gen, repeats: int = 5) -> dict:
    """One packed prefill step as the scheduler plans a burst: ``prompts`` new prompts of ``prompt_len`` random
    tokens filling a step of ``budget`` tokens (the last one cut at the budget; ``--prefill-chunk``), each into
    its own slot.  Median ms of ``prefill_batch`` + synchronise (after one warm-up), prefill tokens/s, and where
    the time goes (torch profiler over one more run): summed GPU kernel ms, kernel launches, profiled wall ms, the
    top GPU kernels and the top CPU ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    items = burst_items(prompts, prompt_len, budget, gen)
    tokens = sum(c.stop() for c in items)

    def once():
        for c in items:
            runner.free(c.slot)
        return runner.prefill_batch(items)

    try:
        once()
        times = [timed(once, dev)[0] for _ in range(repeats)]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t0
    finally:
        for c in items:
            runner.free(c.slot)
    ev = prof.key_averages()
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)  # noqa: E731
    gpu = sorted(((dev_t(e), e.count, e.key) for e in ev if dev_t(e) > 0), reverse=True)
    cpu = sorted(((e.self_cpu_time_total, e.count, e.key) for e in ev), reverse=True)
    ms = statistics.median(times) * 1e3
    return {"chunks": len(items), "tokens": tokens, "ms": ms, "runs_ms": [t * 1e3 for t in times],
            "tokens_per_s": tokens / ms * 1e3, "wall_ms_profiled": wall * 1e3,
            "gpu_kernel_ms": sum(g[0] for g in gpu) / 1e3, "kernels": sum(g[1] for g in gpu),
            "top_gpu": [{"name": k[:120], "ms": t / 1e3, "calls": c} for t, c, k in gpu[:30]],
            "top_cpu_self": [{"name": k[:100], "ms": t / 1e3, "calls": c} for t, c, k in cpu[:15]]}


def agreement(runner, model, dev, lengths, gen) -> list:
    """Per prompt length: the graph path's last-token logits against the eager path's and both against an fp32
    copy of the model (transformers' forward): relative errors and argmax agreement."""
    ref_model = copy.deepcopy(model).float()
    out = []
    try:
        for n in lengths:
            prompt = PreparedPrompt(input_ids=random_ids(n, gen))
            held = runner.graph_prefill
            got = {}
            for name, gp in (("graph", held), ("eager", None)):
                runner.graph_prefill = gp
                runner.free(0)
                got[name] = runner.prefill(0, prompt).float()
                runner.graph_prefill = held
            runner.free(0)
            with torch.no_grad():
                ref = ref_model(input_ids=prompt.input_ids[None].to(dev)).logits[0, -1].float()
            rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
            out.append({"tokens": n, "graph_vs_eager": rel(got["graph"], got["eager"]),
                        "graph_vs_fp32": rel(got["graph"], ref), "eager_vs_fp32": rel(got["eager"], ref),
                        "argmax_graph_eager_fp32": [int(got["graph"].argmax()), int(got["eager"].argmax()),
                                                    int(ref.argmax())]})
    finally:
        del ref_model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


SECTIONS = ("capture", "latency", "follow_up", "kernels", "packed", "packed_agreement", "agreement")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json is added)")
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (checks the script)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                    help=f"run only these sections ({', '.join(SECTIONS)}; default all)")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    lengths = (20, 60, 100, 300, 500, 1000, 2000, 8000) if not args.smoke else (5, 20, 40)
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "errors": {}}
    try:
        import transformers
        doc["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass

    def section(name, fn, key=None):  # the result under doc[key or name]
        if name not in args.only:
            return
        name = key or name
        try:
            doc[name] = fn()
        except Exception:  # noqa: BLE001 - recorded, the run goes on
            doc["errors"][name] = traceback.format_exc()[-2000:]
            print(f"section {name} failed:\n{doc['errors'][name]}", flush=True)
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1))

    model = random_model(dev, args.smoke)
    gen = torch.Generator().manual_seed(0)
    from qwen_chat.engine.model.options import RunnerOptions

    opts = RunnerOptions(prefill_graphs=True)
    runner = ModelRunner(model, num_slots=8, max_context=16384 if not args.smoke else 256, device=dev, options=opts)
    doc["impl"] = runner.impl

    def capture():
        before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        t, held = timed(runner.capture_prefill, dev)
        after = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        return {"graphs": held, "buckets": list(runner.graph_prefill.buckets), "seconds": t,
                "seconds_per_bucket": runner.graph_prefill.capture_seconds, "reserved_gib": (after - before) / 2**30}

    section("capture", capture)
    section("latency", lambda: {str(n): {"graph": latency(runner, dev, PreparedPrompt(input_ids=random_ids(n, gen)), True),
                                         "eager": latency(runner, dev, PreparedPrompt(input_ids=random_ids(n, gen)), False)}
                                for n in lengths}, key="latency_ms")
    hist = 8000 if not args.smoke else 100
    section("follow_up", lambda: {"history": hist, "new": 30,
                                  "graph": follow_up(runner, dev, hist, 30, gen, True),
                                  "eager": follow_up(runner, dev, hist, 30, gen, False)}, key="follow_up_ms")
    k_len = 1000 if not args.smoke else 40
    section("kernels", lambda: {"graph": kernels(runner, dev, k_len, gen, True),
                                "eager": kernels(runner, dev, k_len, gen, False)}, key="kernels_1k")
    # a 32-stream burst of 600-token prompts as the service's scheduler packs it (4,096 prompt tokens a step)
    # and one 4,096-token prompt alone (the same tokens in one chunk)
    # both with the prefill's fused kernels (the service's runner) and without them (``prefill_kernels``)
    runners = {"fused" if runner.options.prefill_kernels else "default": runner}
    if {"packed", "packed_agreement"} & set(args.only):  # a second runner (its own KV) only for them
        runners["unfused"] = ModelRunner(model, num_slots=8, max_context=16384 if not args.smoke else 256,
                                         device=dev, options=RunnerOptions(prefill_graphs=False, prefill_kernels=False))
    section("packed", lambda: [dict(packed_step(r, dev, n, length, budget, gen), runner=name)
                               for n, length, budget in (((7, 600, 4096), (1, 4096, 4096)) if not args.smoke
                                                         else ((3, 30, 80), (1, 80, 80)))
                               for name, r in runners.items()])
    section("packed_agreement", lambda: packed_agreement(runners, model, dev, gen,
                                                         *((7, 600, 4096) if not args.smoke else (3, 30, 80))))
    section("agreement", lambda: agreement(runner, model, dev, (50, 300, 1000) if not args.smoke else (7, 30), gen))
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
    print(f"\n## prefill, {doc['device']}, torch {doc['torch']}, {doc['date']}")
    if "capture" in doc:
        c = doc["capture"]
        print(f"capture: {c['graphs']} graphs, buckets {c['buckets']}, {c['seconds']:.1f} s, "
              f"{c['reserved_gib']:.2f} GiB; per bucket {c['seconds_per_bucket']}")
    print("| prompt tokens | graph ms | eager ms |\n|---|---|---|")
    for n, v in doc.get("latency_ms", {}).items():
        print(f"| {n} | {v['graph']:.1f} | {v['eager']:.1f} |")
    if "follow_up_ms" in doc:
        f = doc["follow_up_ms"]
        print(f"| follow-up: {f['new']} new after {f['history']} | {f['graph']:.1f} | {f['eager']:.1f} |")
    if "kernels_1k" in doc:
        for name, k in doc["kernels_1k"].items():
            print(f"1k {name}: {k['gpu_kernel_ms']:.1f} ms GPU kernels, {k['kernels']} kernels, "
                  f"{k['wall_ms_profiled']:.1f} ms profiled wall; top: "
                  + ", ".join(f"{t['name'][:40]} {t['ms']:.1f} ms x{t['calls']}" for t in k["top_gpu"][:6]))
    for p in doc.get("packed", []):
        print(f"packed step ({p['runner']}) {p['chunks']} chunks, {p['tokens']} tokens: {p['ms']:.1f} ms, {p['tokens_per_s']:.0f} "
              f"tok/s; GPU kernels {p['gpu_kernel_ms']:.1f} ms in {p['kernels']}, profiled wall "
              f"{p['wall_ms_profiled']:.1f} ms; top: "
              + ", ".join(f"{t['name'][:50]} {t['ms']:.1f} ms x{t['calls']}" for t in p["top_gpu"][:12]))
    if "packed_agreement" in doc:
        print("packed step agreement:", json.dumps(doc["packed_agreement"]))
    for a in doc.get("agreement", []):
        print(f"agreement {a['tokens']} tokens: graph/eager {a['graph_vs_eager']:.2e}, graph/fp32 "
              f"{a['graph_vs_fp32']:.2e}, eager/fp32 {a['eager_vs_fp32']:.2e}, argmax {a['argmax_graph_eager_fp32']}")
    if doc["errors"]:
        print("errors in:", ", ".join(doc["errors"]))
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
