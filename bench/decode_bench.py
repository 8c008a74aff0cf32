"""Decode benchmark of the engine's ModelRunner + Sampler on the full published Qwen3.5-9B config.

Usage (one GPU host, from the repository root):

    python bench/decode_bench.py                 # writes bench/results/<date>-<gpu>-single.json and .png
    python bench/decode_bench.py --smoke         # tiny config on CPU: checks the script, numbers meaningless
    python bench/decode_bench.py --quantize fp8 --skip-eager-glue   # FP8 weights (--quantize fp8): ...-single-fp8.json
    python bench/decode_bench.py --quantize int4 --skip-eager-glue  # 4-bit weights: ...-single-int4.json

Weights are random bf16 built directly on the GPU (the speed of a forward does not depend on weight values);
with ``--quantize fp8`` / ``int4`` the text decoder's linear layers are then quantised as the service's
``--quantize`` does (``fp8_loading`` / ``int4_loading.quantize_model``), so every section runs on FP8 or 4-bit
weights (the roofline counts their bytes).
In one run it measures: device-to-device copy bandwidth and the batch-1 roofline (bytes of weights read per
decode step / bandwidth); plain transformers ``generate`` (the baseline); the engine's batch-1 decode tok/s,
TTFT for 1k- and 8k-token text prompts and for a ~1-megapixel image prompt, TTFT of 1 and 8 ~600-token prompts
prefilled together in one packed ``prefill_batch`` against one by one, aggregate decode tok/s at 1, 4, 16
and 32 concurrent streams (512-token prompts, 256 new tokens), peak GPU memory; greedy agreement of the first
32 tokens of 8 prompts with transformers ``generate`` in bf16; the ratios engine/baseline and engine/roofline.
Timing: CUDA synchronised wall clock around whole steps (what a user sees), medians over repeats.
Every section is guarded: a failure is recorded in the JSON and the run goes on.  The table is printed last.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen_chat.engine.types import PreparedPrompt, SamplingParams  # noqa: E402
from qwen_chat.engine.model.options import RunnerOptions  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PrefillItem  # noqa: E402
from qwen_chat.engine.model.sampling import Sampler  # noqa: E402

CONFIG = Path(__file__).with_name("qwen3_5_9b_config.json")
PRESET = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)  # model card, non-thinking general


def build_config(smoke: bool):
    from transformers import Qwen3_5Config

    raw = json.loads(CONFIG.read_text())
    if smoke:
        tc, vc = raw["text_config"], raw["vision_config"]
        tc.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=tc["layer_types"][:4],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                  linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=16, vocab_size=248320)
        tc["rope_parameters"]["mrope_section"] = [2, 1, 1]
        vc.update(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64)
    return Qwen3_5Config(**raw)


def random_model(dev, smoke: bool):
    """``Qwen3_5ForConditionalGeneration`` of ``build_config(smoke)`` with random bf16 weights (seed 0) built on
    ``dev``, in eval mode."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            return Qwen3_5ForConditionalGeneration(build_config(smoke)).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev):
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t, out


def measure_bandwidth(dev, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median of 10 copies)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        t, _ = timed(lambda: dst.copy_(src), dev)
        times.append(t)
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a batch-1 decode step reads: every text weight except the input embedding (which is
    only gathered), with the buffers (FP8 block scales, 4-bit scales and zero points), plus the LM head (read in
    full)."""
    lm = model.model.language_model
    emb = lm.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in lm.parameters() if p is not emb)
    total += sum(b.numel() * b.element_size() for b in lm.buffers())
    return total + sum(p.numel() * p.element_size() for p in model.lm_head.parameters())


def random_ids(n: int, gen: torch.Generator, vocab: int = 240000) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=gen)


def baseline_generate(model, dev, prompt_len: int, new: int, gen) -> dict:
    """transformers generate, batch 1, greedy, ``new`` tokens forced; (t(new+1) - t(1)) / new per token."""
    ids = random_ids(prompt_len, gen)[None].to(dev)
    kw = dict(do_sample=False, pad_token_id=0)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    t1, _ = timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), dev)
    tn, _ = timed(lambda: model.generate(ids, max_new_tokens=new + 1, min_new_tokens=new + 1, **kw), dev)
    step = (tn - t1) / new
    return {"prompt_tokens": prompt_len, "new_tokens": new, "ms_per_token": step * 1e3, "tok_s": 1.0 / step}


def greedy_agreement(model, runner, dev, n_prompts: int, prompt_len: int, new: int, gen) -> dict:
    """First ``new`` greedy tokens of ``n_prompts`` prompts: engine vs transformers generate (same dtype)."""
    prompts = torch.stack([random_ids(prompt_len, gen) for _ in range(n_prompts)])
    ref = model.generate(prompts.to(dev), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0)[:, prompt_len:].cpu()
    with torch.no_grad():
        ref_logits = model(input_ids=prompts[:1].to(dev)).logits[0, -1].float()
    slots = list(range(n_prompts))
    for s in slots:
        runner.free(s)
    first = [runner.prefill(s, PreparedPrompt(input_ids=prompts[s])) for s in slots]
    rel = float((first[0] - ref_logits).abs().max() / ref_logits.abs().max())
    toks = [[int(lg.argmax())] for lg in first]
    for _ in range(new - 1):
        lg = runner.decode(slots, torch.tensor([t[-1] for t in toks], device=dev))
        for t, nxt in zip(toks, lg.argmax(-1).tolist()):
            t.append(nxt)
    ours = torch.tensor(toks)
    # Teacher-forced: feed the reference's tokens, compare each step's logits with one full reference forward
    # (separates real errors from free-running divergence at near-ties of random-weight logits).
    with torch.no_grad():
        full = torch.cat([prompts, ref], dim=1).to(dev)
        ref_all = model(input_ids=full).logits[:, prompt_len - 1:prompt_len + new - 1].float()  # [n, new, V]
    tf = []
    for s in slots:
        runner.free(s)
    tf.append(torch.stack([runner.prefill(s, PreparedPrompt(input_ids=prompts[s])) for s in slots]))
    for j in range(new - 1):
        tf.append(runner.decode(slots, ref[:, j].to(dev)))
    tf = torch.stack(tf, dim=1)  # [n, new, V]
    tf_rel = ((tf - ref_all).abs().amax(-1) / ref_all.abs().amax(-1))
    top2 = ref_all.topk(2, dim=-1).values
    prefix = []
    for r in range(n_prompts):
        diff = (ours[r] != ref[r]).nonzero()
        prefix.append(int(diff[0]) if len(diff) else new)
    for s in slots:
        runner.free(s)
    return {"prompts": n_prompts, "prompt_tokens": prompt_len, "tokens": new,
            "position_agreement": float((ours == ref).float().mean()),
            "mean_matching_prefix": statistics.mean(prefix), "matching_prefix": prefix,
            "all_identical": bool((ours == ref).all()), "prefill_logits_rel_err_prompt0": rel,
            "teacher_forced_top1_agreement": float((tf.argmax(-1) == ref_all.argmax(-1)).float().mean()),
            "teacher_forced_logits_rel_err_max": float(tf_rel.max()),
            "teacher_forced_logits_rel_err_median": float(tf_rel.median()),
            "reference_top2_gap_median": float((top2[..., 0] - top2[..., 1]).median()),
            "reference_logit_absmax_median": float(ref_all.abs().amax(-1).median())}


def decode_ahead(executor, slots: list, steps: int) -> None:
    """``steps`` decode steps of ``slots`` through ``executor`` (a LocalExecutor), each launched before the
    previous one's tokens are collected, as the scheduler does in one process (tokens fed on the device)."""
    from qwen_chat.engine.types import StepPlan

    plan = StepPlan(decode_slots=list(slots), tokens_on_device=True)
    inflight = executor.launch(plan)
    for _ in range(steps - 1):
        ahead = executor.launch(plan)
        executor.collect(inflight)
        inflight = ahead
    executor.collect(inflight)


def engine_decode(runner, sampler, dev, batch: int, prompt_len: int, new: int, gen, pipelined: bool = True) -> dict:
    """Prefill ``batch`` prompts (first token sampled), then ``new - 1`` batched decode steps, timed.

    pipelined (what the service's scheduler does in one process): ``LocalExecutor.launch`` queues step N+1 on
    the device, fed from the device's copy of step N's tokens, before ``collect`` waits for step N's tokens.
    Otherwise each step is ``runner.decode`` + ``sampler.sample`` and waits for its tokens (the host and the GPU
    take turns)."""
    from qwen_chat.engine.parallel.executors import LocalExecutor
    from qwen_chat.engine.types import PrefillItem, StepPlan

    slots = list(range(batch))
    ex = LocalExecutor(runner, sampler)
    last = []
    for s in slots:
        sp = SamplingParams(seed=1000 + s, max_new_tokens=new, stop_token_ids=(), **PRESET)
        item = PrefillItem(s, PreparedPrompt(input_ids=random_ids(prompt_len, gen)), sp)
        last.append(ex.execute(StepPlan(free_slots=[s], prefills=[item]))[s])
    steps = new - 1
    sync(dev)
    t0 = time.perf_counter()
    if pipelined:
        decode_ahead(ex, slots, steps)
    else:
        tokens = torch.tensor(last)  # host ints, as the executor feeds them
        for _ in range(steps):
            tokens = torch.tensor(sampler.sample(slots, runner.decode(slots, tokens)))
    sync(dev)
    total = time.perf_counter() - t0
    for s in slots:
        runner.free(s)
    return {"streams": batch, "prompt_tokens": prompt_len, "decode_steps": steps, "pipelined": pipelined,
            "aggregate_tok_s": batch * steps / total, "per_stream_tok_s": steps / total,
            "mean_step_ms": total / steps * 1e3, "sampling": True}


def scheduler_decode(runner, sampler, dev, prompt_len: int, new: int, gen, overlap: bool = True) -> dict:
    """Batch-1 decode as the service runs it: one request through the rank-0 ``Scheduler`` and
    ``LocalExecutor`` (plans, sampling, token routing to the request's stream), with steps launched ahead
    (``overlap``, the service's mode in one process) or not.  Decode tok/s = (tokens - 1) / (time of the last
    token - time of the first)."""
    from qwen_chat.chat_types import CancelToken
    from qwen_chat.engine.parallel.executors import LocalExecutor
    from qwen_chat.engine.core.scheduler import Scheduler

    sched = Scheduler(LocalExecutor(runner, sampler), num_slots=runner.num_slots, max_queue=4, eos_ids=(),
                      max_context=runner.max_context, overlap=overlap, num_blocks=runner.num_blocks,
                      block_tokens=runner.block_tokens)
    try:
        prompt = PreparedPrompt(input_ids=random_ids(prompt_len, gen), max_new_tokens=new)
        params = SamplingParams(seed=7, max_new_tokens=new, stop_token_ids=(), **PRESET)
        t_submit = time.perf_counter()
        stamps = [time.perf_counter() for _ in sched.submit(prompt, params, CancelToken())]
        totals = sched.stats()["totals"]
    finally:
        sched.shutdown()
    return {"prompt_tokens": prompt_len, "tokens": len(stamps), "ttft_ms": (stamps[0] - t_submit) * 1e3,
            "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "ms_per_step_in_executor": totals["step_seconds"] / totals["steps"] * 1e3, "steps": totals["steps"],
            "ms_per_token_seen": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3}


def scheduler_repeats(runner, sampler, dev, prompt_len: int, new: int, gen, repeats: int = 3) -> dict:
    """``scheduler_decode`` ``repeats`` times with the default GIL switch interval, then as many with 0.5 ms."""
    out = {"default_switch": [scheduler_decode(runner, sampler, dev, prompt_len, new, gen) for _ in range(repeats)]}
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    try:
        out["switch_0.5ms"] = [scheduler_decode(runner, sampler, dev, prompt_len, new, gen) for _ in range(repeats)]
    finally:
        sys.setswitchinterval(old)
    return out


def executor_decode(runner, sampler, dev, prompt_len: int, new: int, gen) -> dict:
    """Batch-1 decode through ``LocalExecutor.execute`` on this thread (step plans, sampling, no scheduler
    thread): separates the executor's cost from the scheduler's in ``scheduler_decode``."""
    from qwen_chat.engine.parallel.executors import LocalExecutor
    from qwen_chat.engine.types import PrefillItem, StepPlan

    ex = LocalExecutor(runner, sampler)
    params = SamplingParams(seed=7, max_new_tokens=new, stop_token_ids=(), **PRESET)
    prompt = PreparedPrompt(input_ids=random_ids(prompt_len, gen), max_new_tokens=new)
    tok = ex.execute(StepPlan(free_slots=[0], prefills=[PrefillItem(0, prompt, params)]))[0]
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(new - 1):
        tok = ex.execute(StepPlan(decode_slots=[0], decode_tokens=[tok]))[0]
    dt_s = time.perf_counter() - t0
    runner.free(0)
    return {"prompt_tokens": prompt_len, "decode_steps": new - 1, "decode_tok_s": (new - 1) / dt_s}


def profile_scheduler(runner, sampler, dev, prompt_len: int, new: int, gen) -> dict:
    """CPU-side profile of batch-1 decode through the scheduler (what the service runs): wall ms per token and
    the CPU ops with the most self time, to show where the time beyond the GPU kernels goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = scheduler_decode(runner, sampler, dev, prompt_len, new, gen)
    ev = prof.key_averages()
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    cpu = sorted(((e.self_cpu_time_total, e.count, e.key) for e in ev), reverse=True)
    return {"profiled_decode_tok_s": res["decode_tok_s"], "tokens": res["tokens"],
            "gpu_kernel_ms_total": sum(dev_t(e) for e in ev) / 1e3,
            "top_cpu_self": [{"name": k[:100], "ms": t / 1e3, "calls": c} for t, c, k in cpu[:25]]}


def first_eager_prefills(runner, dev, lengths, gen) -> list:
    """Wall time of the first (eager) prefill at each length (one-off kernel compilation/tuning shows here),
    then a second run of the same length."""
    rows = []
    for n in lengths:
        prompt = PreparedPrompt(input_ids=random_ids(n, gen))
        runner.free(0)
        first, _ = timed(lambda: runner.prefill(0, prompt), dev)
        runner.free(0)
        second, _ = timed(lambda: runner.prefill(0, prompt), dev)
        runner.free(0)
        rows.append({"prompt_tokens": n, "first_ms": first * 1e3, "second_ms": second * 1e3})
    return rows


def prefill_batched(runner, sampler, dev, counts, prompt_len: int, gen, repeats: int = 3) -> list:
    """TTFT of ``n`` prompts of ``prompt_len`` tokens (each n of ``counts``) arriving together: prefilled in one
    packed ``runner.prefill_batch`` call (one forward) and their first tokens sampled in one call, against
    ``runner.prefill`` + ``sampler.sample`` one prompt after the other.  Together, every prompt gets its first
    token at the end (``batched_ms``); one by one, prompt i gets it after the first i prefills (``one_by_one_ms``:
    the last prompt's TTFT, ``one_by_one_mean_ttft_ms``: the mean over the prompts).  Medians of ``repeats``
    after a warm-up of each."""
    rows = []
    for n in counts:
        slots = list(range(n))
        prompts = [PreparedPrompt(input_ids=random_ids(prompt_len, gen)) for _ in slots]

        def reset():
            for s in slots:
                runner.free(s)
                sampler.start(s, SamplingParams(seed=1 + s, max_new_tokens=8, stop_token_ids=(), **PRESET))

        def together():
            reset()
            sync(dev)
            t0 = time.perf_counter()
            logits = runner.prefill_batch([PrefillItem(s, p) for s, p in zip(slots, prompts)])
            sampler.sample(slots, logits)  # host ints: waits for the device
            return time.perf_counter() - t0

        def one_by_one():
            reset()
            sync(dev)
            t0, stamps = time.perf_counter(), []
            for s, p in zip(slots, prompts):
                sampler.sample([s], runner.prefill(s, p)[None])
                stamps.append(time.perf_counter() - t0)
            return stamps

        together()
        one_by_one()
        t_tog = [together() for _ in range(repeats)]
        t_one = [one_by_one() for _ in range(repeats)]
        for s in slots:
            runner.free(s)
        last = statistics.median(x[-1] for x in t_one)
        batched = statistics.median(t_tog)
        rows.append({"prompts": n, "prompt_tokens": prompt_len, "batched_ms": batched * 1e3,
                     "one_by_one_ms": last * 1e3,
                     "one_by_one_mean_ttft_ms": statistics.median(statistics.mean(x) for x in t_one) * 1e3,
                     "batched_prefill_tok_s": n * prompt_len / batched,
                     "one_by_one_prefill_tok_s": n * prompt_len / last,
                     "speedup": last / batched, "batched_runs_ms": [t * 1e3 for t in t_tog],
                     "one_by_one_runs_ms": [x[-1] * 1e3 for x in t_one]})
    return rows


def profile_decode(runner, dev, batch: int, prompt_len: int, steps: int, gen) -> dict:
    """GPU kernel time of ``steps`` decode steps (CUDA graph replays) by kernel name, from torch.profiler:
    shows where a step's time goes (weight GEMVs vs element-wise glue vs attention/state traffic)."""
    from torch.profiler import ProfilerActivity, profile

    slots = list(range(batch))
    for s in slots:
        runner.free(s)
        runner.prefill(s, PreparedPrompt(input_ids=random_ids(prompt_len, gen)))
    tokens = torch.zeros(batch, dtype=torch.long, device=dev)
    runner.decode(slots, tokens)
    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.decode(slots, tokens)
        sync(dev)
    wall = (time.perf_counter() - t0) / steps
    for s in slots:
        runner.free(s)
    rows, total, count = [], 0.0, 0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        rows.append((t, e.count, e.key))
    kernels = [r for r in rows if not r[2].startswith(("cudaGraph", "Memcpy", "Memset"))]
    total = sum(r[0] for r in kernels)
    count = sum(r[1] for r in kernels)
    kernels.sort(reverse=True)
    return {"batch": batch, "steps": steps, "wall_ms_per_step": wall * 1e3,
            "kernel_ms_per_step": total / 1e3 / steps, "kernels_per_step": count / steps,
            "top": [{"name": k[:120], "ms_per_step": t / 1e3 / steps, "calls_per_step": c / steps}
                    for t, c, k in kernels[:25]]}


def profile_prefill(runner, dev, prompt_len: int, gen) -> dict:
    """Where a prefill's time goes: wall time vs summed GPU kernel time, top GPU kernels and top CPU ops."""
    from torch.profiler import ProfilerActivity, profile

    prompt = PreparedPrompt(input_ids=random_ids(prompt_len, gen))
    runner.free(0)
    runner.prefill(0, prompt)
    runner.free(0)
    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.prefill(0, prompt)
        sync(dev)
    wall = time.perf_counter() - t0
    runner.free(0)
    ev = prof.key_averages()
    dev_t = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    gpu = sorted(((dev_t(e), e.count, e.key) for e in ev if dev_t(e) > 0), reverse=True)
    cpu = sorted(((e.self_cpu_time_total, e.count, e.key) for e in ev), reverse=True)
    return {"prompt_tokens": prompt_len, "wall_ms_profiled": wall * 1e3,
            "gpu_kernel_ms": sum(g[0] for g in gpu) / 1e3, "kernels": sum(g[1] for g in gpu),
            "top_gpu": [{"name": k[:100], "ms": t / 1e3, "calls": c} for t, c, k in gpu[:15]],
            "top_cpu_self": [{"name": k[:100], "ms": t / 1e3, "calls": c} for t, c, k in cpu[:15]]}


def ttft(runner, sampler, dev, prompt: PreparedPrompt, repeats: int) -> dict:
    """Prefill + first sampled token, synchronised; first run is a warm-up."""
    sampler.start(0, SamplingParams(seed=1, max_new_tokens=8, stop_token_ids=(), **PRESET))

    def once():
        runner.free(0)
        return sampler.sample([0], runner.prefill(0, prompt)[None])

    once()
    times = [timed(once, dev)[0] for _ in range(repeats)]
    runner.free(0)
    return {"prompt_tokens": prompt.num_tokens, "ttft_ms": statistics.median(times) * 1e3,
            "runs_ms": [t * 1e3 for t in times]}


def image_prompt(config, gen, side_px: int) -> PreparedPrompt:
    """A ``side_px`` x ``side_px`` image (random pixels) between short texts, shaped as the processor would."""
    vc = config.vision_config
    patches = side_px // vc.patch_size
    grid = torch.tensor([[1, patches, patches]])
    n_tok = patches * patches // vc.spatial_merge_size ** 2
    pv = torch.randn(patches * patches, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=gen)
    ids = torch.cat([random_ids(20, gen), torch.tensor([config.vision_start_token_id]),
                     torch.full((n_tok,), config.image_token_id), torch.tensor([config.vision_end_token_id]),
                     random_ids(20, gen)])
    return PreparedPrompt(input_ids=ids, pixel_values=pv, image_grid_thw=grid,
                          mm_token_type_ids=(ids == config.image_token_id).long())


class Run:
    """Collects sections into one JSON document, saving after each one."""

    def __init__(self, paths):
        self.paths, self.doc = paths, {"sections": {}, "errors": {}}

    def section(self, name, fn):
        t = time.perf_counter()
        try:
            self.doc["sections"][name] = fn()
            status = "ok"
        except Exception as exc:  # record and continue: one broken section must not lose the others
            self.doc["errors"][name] = "".join(traceback.format_exception(exc))[-3000:]
            status = f"FAILED: {exc!r}"[:300]
        print(f"[{time.perf_counter() - t:7.1f} s] {name}: {status}", flush=True)
        self.save()
        return self.doc["sections"].get(name)

    def save(self):
        for p in self.paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(self.doc, indent=1, default=str))


def plot(doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["sections"]
    rows = s.get("streams", {}).get("compiled", [])
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows:
        ax.plot([r["streams"] for r in rows], [r["aggregate_tok_s"] for r in rows], "o-", label="engine")
    rows_e = s.get("streams", {}).get("eager_glue", [])
    if rows_e:
        ax.plot([r["streams"] for r in rows_e], [r["aggregate_tok_s"] for r in rows_e], "s--",
                label="engine, glue not compiled")
    if "baseline" in s:
        ax.plot([1], [s["baseline"]["tok_s"]], "x", ms=10, label="transformers generate")
    if "hardware" in s:
        ax.axhline(s["hardware"]["roofline_batch1_tok_s"], color="grey", ls=":", label="batch-1 roofline")
    ax.axhline(2000, color="red", ls=":", lw=0.8, label="target at 32 streams")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"Qwen3.5-9B decode, {doc['env'].get('gpu', 'cpu')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(doc) -> str:
    s, lines = doc["sections"], []

    def row(name, value, target=""):
        lines.append(f"{name:<44} {value:>16} {target:>16}")

    row("metric", "value", "target")
    hw = s.get("hardware", {})
    if hw:
        row("copy bandwidth (GB/s)", f"{hw['copy_bandwidth_gb_s']:.0f}")
        row("weight bytes per decode step (GB)", f"{hw['weight_bytes_per_step'] / 1e9:.2f}")
        row("batch-1 roofline (tok/s)", f"{hw['roofline_batch1_tok_s']:.0f}")
    if "baseline" in s:
        row("transformers generate batch 1 (tok/s)", f"{s['baseline']['tok_s']:.1f}")
    for key, label in (("batch1_compiled", "engine batch 1, steps launched ahead (tok/s)"),
                       ("batch1_compiled_sync", "engine batch 1, each step waited for (tok/s)"),
                       ("batch1_eager_glue", "engine batch 1, glue not compiled (tok/s)")):
        if key in s:
            row(label, f"{s[key]['aggregate_tok_s']:.1f}", ">= 200" if key == "batch1_compiled" else "")
    r = doc.get("ratios", {})
    if r:
        row("engine / baseline", f"{r.get('engine_over_baseline', float('nan')):.1f}x", ">= 20x")
        row("engine / roofline", f"{r.get('engine_over_roofline', float('nan')) * 100:.0f}%", ">= 75%")
    for key, target in (("ttft_1k", "<= 60 ms"), ("ttft_8k", ""), ("ttft_image_1mp", "")):
        if key in s:
            row(f"TTFT {key[5:]} ({s[key]['prompt_tokens']} tok) ms", f"{s[key]['ttft_ms']:.1f}", target)
    for variant, rows in s.get("streams", {}).items():
        for x in rows:
            row(f"{variant}: {x['streams']} streams aggregate tok/s", f"{x['aggregate_tok_s']:.0f}",
                ">= 2000" if x["streams"] == 32 and variant == "compiled" else "")
    if "batch1_scheduler" in s:
        row("engine batch 1 via scheduler (tok/s)", f"{s['batch1_scheduler']['decode_tok_s']:.1f}")
    if "batch1_scheduler_sync" in s:
        row("  same, overlap off (tok/s)", f"{s['batch1_scheduler_sync']['decode_tok_s']:.1f}")
    if "profile_scheduler_b1" in s:
        row("profiled scheduler path (tok/s)", f"{s['profile_scheduler_b1']['profiled_decode_tok_s']:.1f}")
    for variant, rows in s.get("scheduler_repeats", {}).items():
        row(f"scheduler {variant}: tok/s (executor ms/step)",
            " ".join(f"{x['decode_tok_s']:.0f}({x['ms_per_step_in_executor']:.2f})" for x in rows))
    if "batch1_executor" in s:
        row("engine batch 1 via executor (tok/s)", f"{s['batch1_executor']['decode_tok_s']:.1f}")
    for x in s.get("first_eager_prefills", []):
        row(f"first eager prefill {x['prompt_tokens']} tok: 1st / 2nd ms", f"{x['first_ms']:.0f} / {x['second_ms']:.0f}")
    for x in s.get("prefill_batched", []):
        row(f"TTFT {x['prompts']} x {x['prompt_tokens']} tok: together / one by one ms",
            f"{x['batched_ms']:.1f} / {x['one_by_one_ms']:.1f}")
    if "greedy" in s:
        g = s["greedy"]
        row("greedy agreement (positions)", f"{g['position_agreement'] * 100:.1f}%")
        row("greedy mean matching prefix (of 32)", f"{g['mean_matching_prefix']:.1f}")
        row("prefill logits rel err vs transformers", f"{g['prefill_logits_rel_err_prompt0']:.2e}")
        row("teacher-forced top-1 agreement", f"{g['teacher_forced_top1_agreement'] * 100:.1f}%")
        row("teacher-forced logits rel err (max)", f"{g['teacher_forced_logits_rel_err_max']:.2e}")
        row("reference top-2 logit gap (median)", f"{g['reference_top2_gap_median']:.2e}")
    if "profile_prefill_1k" in s:
        p = s["profile_prefill_1k"]
        row("prefill 1k: GPU kernel ms (profiled wall ms)", f"{p['gpu_kernel_ms']:.1f} ({p['wall_ms_profiled']:.1f})")
    for key in [k for k in s if k.startswith("profile_") and "kernel_ms_per_step" in s[k]]:
        p = s[key]
        row(f"{key}: kernel ms/step (wall ms)", f"{p['kernel_ms_per_step']:.2f} ({p['wall_ms_per_step']:.2f})")
        row(f"{key}: kernels per step", f"{p['kernels_per_step']:.0f}")
    if "peak_memory_gb" in doc:
        row("peak GPU memory (GB)", f"{doc['peak_memory_gb']:.1f}")
    for name in doc["errors"]:
        row(f"FAILED section: {name}", "")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (checks the script only)")
    ap.add_argument("--mode", default="single", help="label in the result file name (single GPU: 'single')")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--skip-eager-glue", action="store_true", help="skip the not-compiled comparison")
    ap.add_argument("--quantize", choices=("fp8", "int4"),
                    help="FP8 or 4-bit weights, as the service's --quantize fp8 / int4")
    args = ap.parse_args(argv)
    if args.quantize and args.mode == "single":
        args.mode = f"single-{args.quantize}"

    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    gpu = "cpu" if smoke else torch.cuda.get_device_name(dev).replace(" ", "-")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    stem = f"{stamp}-{gpu}-{args.mode}" + ("-smoke" if smoke else "")
    paths = [args.out / f"{stem}.json"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / f"{stem}.json")
    run = Run(paths)
    import transformers

    try:
        import fla
        fla_version = getattr(fla, "__version__", "present")
    except Exception:
        fla_version = None
    run.doc["env"] = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
                      "torch": torch.__version__, "transformers": transformers.__version__, "fla": fla_version,
                      "cuda": torch.version.cuda, "command": " ".join(["python", "bench/decode_bench.py"] +
                                                                      (argv if argv is not None else sys.argv[1:]))}
    # Sizes (smoke: tiny, to exercise every path on CPU in seconds)
    P = dict(prompt=512, new=256, base_new=16, b1_new=129, ttft_1k=1024, ttft_8k=8192, img_px=1024,
             streams=(1, 4, 16, 32), max_context=9216, prefill_batch=(1, 8), prefill_batch_len=600,
             first_eager=(2500, 4500, 6500, 8192), greedy_n=8, greedy_len=64, greedy_new=32, bw_bytes=2 << 30)
    if smoke:
        P.update(prompt=24, new=6, base_new=2, b1_new=5, ttft_1k=40, ttft_8k=80, img_px=64, streams=(1, 4),
                 max_context=256, greedy_n=2, prefill_batch=(1, 4), prefill_batch_len=30, first_eager=(50, 60),
                 greedy_len=10, greedy_new=4, bw_bytes=1 << 20)
    run.doc["sizes"] = {k: v for k, v in P.items()}
    gen = torch.Generator().manual_seed(0)
    config = build_config(smoke)

    def build():
        from transformers import Qwen3_5ForConditionalGeneration

        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(dev):
                model = Qwen3_5ForConditionalGeneration(config)
        finally:
            torch.set_default_dtype(old)
        return model.eval()

    t, model = timed(build, dev)
    n_params = sum(p.numel() for p in model.parameters())
    run.doc["model"] = {"parameters": n_params, "dtype": str(next(model.parameters()).dtype), "build_s": t}
    if args.quantize:
        from qwen_chat.engine.checkpoints import fp8_loading, int4_loading
        from qwen_chat.engine.model.fp8 import weights_report

        quantize_model = (fp8_loading if args.quantize == "fp8" else int4_loading).quantize_model

        tq, _ = timed(lambda: quantize_model(model, device=dev), dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        run.doc["model"].update(quantize_s=tq, weights=weights_report(model),
                                allocated_gb=torch.cuda.memory_allocated(dev) / 1e9 if dev.type == "cuda" else None)
    print(f"model: {n_params / 1e9:.2f} B parameters built in {t:.1f} s", flush=True)

    def hardware():
        bw = measure_bandwidth(dev, P["bw_bytes"])
        wb = weight_bytes_per_step(model)
        return {"copy_bandwidth_gb_s": bw / 1e9, "weight_bytes_per_step": wb,
                "roofline_batch1_ms": wb / bw * 1e3, "roofline_batch1_tok_s": bw / wb}

    run.section("hardware", hardware)
    with torch.no_grad():
        run.section("baseline", lambda: baseline_generate(model, dev, P["prompt"], P["base_new"], gen))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    runners = {}

    def make(name, compile_glue):
        def f():
            t, r = timed(lambda: ModelRunner(model, num_slots=max(P["streams"]), max_context=P["max_context"],
                                             device=dev, options=RunnerOptions(compile_glue=compile_glue)), dev)
            runners[name] = (r, Sampler(r.num_slots, r.vocab_size, dev))
            return {"init_s": t, "impl": r.impl}
        return f

    streams: dict[str, list] = {}
    run.doc["sections"]["streams"] = streams
    variants = [("compiled", None)] + ([] if args.skip_eager_glue else [("eager_glue", False)])
    for name, cg in variants:
        if run.section(f"runner_{name}", make(name, cg)) is None:
            continue
        runner, sampler = runners[name]

        def warm(runner=runner, sampler=sampler):
            t0 = time.perf_counter()
            for b in P["streams"]:
                runner.capture_all([next(x for x in (1, 2, 4, 8, 16, 32, 48, 64) if x >= b)],
                                   [runner.context_bucket(P["prompt"] + P["new"])])
            sampler.warm_up()
            graphs = runner.graphs
            return {"capture_s": time.perf_counter() - t0, "graphs": len(graphs.decode_shapes()) if graphs else 0}

        run.section(f"capture_{name}", warm)
        res = run.section(f"batch1_{name}", lambda: engine_decode(runner, sampler, dev, 1, P["prompt"],
                                                                   P["b1_new"], gen))
        run.section(f"batch1_{name}_sync", lambda: engine_decode(runner, sampler, dev, 1, P["prompt"],
                                                                 P["b1_new"], gen, pipelined=False))
        run.section(f"profile_{name}_b1", lambda: profile_decode(runner, dev, 1, P["prompt"], 5, gen))
        if name == "compiled":
            run.section(f"profile_{name}_b32", lambda: profile_decode(runner, dev, max(P["streams"]), P["prompt"],
                                                                      3, gen))
            run.section("greedy", lambda: greedy_agreement(model, runner, dev, P["greedy_n"], P["greedy_len"],
                                                           P["greedy_new"], gen))
            run.section("ttft_1k", lambda: ttft(runner, sampler, dev,
                                                PreparedPrompt(input_ids=random_ids(P["ttft_1k"], gen)), 3))
            run.section("profile_prefill_1k", lambda: profile_prefill(runner, dev, P["ttft_1k"], gen))
            run.section("first_eager_prefills", lambda: first_eager_prefills(runner, dev, P["first_eager"], gen))
            run.section("ttft_8k", lambda: ttft(runner, sampler, dev,
                                                PreparedPrompt(input_ids=random_ids(P["ttft_8k"], gen)), 2))
            run.section("ttft_image_1mp", lambda: ttft(runner, sampler, dev,
                                                       image_prompt(config, gen, P["img_px"]), 2))
            run.section("prefill_batched", lambda: prefill_batched(runner, sampler, dev, P["prefill_batch"],
                                                                   P["prefill_batch_len"], gen))
            run.section("batch1_scheduler", lambda: scheduler_decode(runner, sampler, dev, P["prompt"],
                                                                     P["b1_new"], gen))
            run.section("batch1_scheduler_sync", lambda: scheduler_decode(runner, sampler, dev, P["prompt"],
                                                                          P["b1_new"], gen, overlap=False))
            run.section("batch1_executor", lambda: executor_decode(runner, sampler, dev, P["prompt"],
                                                                   P["b1_new"], gen))
            run.section("scheduler_repeats", lambda: scheduler_repeats(runner, sampler, dev, P["prompt"],
                                                                       P["b1_new"], gen))
            run.section("profile_scheduler_b1", lambda: profile_scheduler(runner, sampler, dev, P["prompt"],
                                                                          40, gen))
        rows = []
        for b in P["streams"]:
            if b == 1 and res is not None:
                rows.append(res)
                continue
            r = run.section(f"streams_{name}_{b}", lambda b=b: engine_decode(runner, sampler, dev, b, P["prompt"],
                                                                             P["new"], gen))
            if r is not None:
                rows.append(r)
        streams[name] = rows
        if name == "compiled" and dev.type == "cuda":
            run.doc["peak_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        del runners[name]
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    s = run.doc["sections"]
    if "batch1_compiled" in s:
        eng = s["batch1_compiled"]["aggregate_tok_s"]
        run.doc["ratios"] = {"engine_over_baseline": eng / s["baseline"]["tok_s"] if "baseline" in s else None,
                             "engine_over_roofline": eng / s["hardware"]["roofline_batch1_tok_s"]
                             if "hardware" in s else None}
    run.save()
    try:
        png = paths[0].with_suffix(".png")
        plot(run.doc, png)
        if len(paths) > 1:
            plot(run.doc, paths[1].with_suffix(".png"))
    except Exception as exc:
        print(f"plot failed: {exc!r}")
    print("\n" + table(run.doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
