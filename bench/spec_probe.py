"""Why speculative decoding is slower than plain decoding on the GPU, and where its replies leave plain decoding's.

Usage (repository root; one GPU; the random full-config checkpoint of bench/serve_ckpt.py, cached):

    python bench/spec_probe.py --out PREFIX        # writes PREFIX.json and prints a table last

Two questions that ``bench/spec_bench.py`` (the speed-up at simulated acceptance) left open on an H200:

1. **Where do the speculative replies first differ from plain decoding's**, and is it a near tie?  Plain
   decoding is run twice (is plain decoding itself repeatable?), then each K with every draft right (oracle rate
   1.0).  At the first differing position the plain path's logits (one prefill of the prompt and the tokens
   before it, fp32 logits) give the top-2 gap and the logit difference between plain's token and the
   speculative run's: a gap of a few bf16 roundings (the logits' scale is printed beside it) means the two
   paths' different matrix shapes round differently, not that a state is wrong.
2. **Where the time of one speculative step goes**: one stream, K given drafts, ``torch.profiler`` over 10 steps
   after 3 warm-up steps, against plain decode steps: wall ms per step, CUDA kernels launched per step, GPU
   busy ms per step, and the 12 kernels / operators with the most GPU time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from spec_bench import Engine, prompts, progress  # noqa: E402

from qwen_chat.engine.core.spec_policy import OracleDrafter  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt, SamplingParams  # noqa: E402

TOKENS = 512


def first_difference(a: list[int], b: list[int]):
    """Index of the first position where two token lists differ (the shorter's length when one is a prefix of
    the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_gap(eng: Engine, prompt: PreparedPrompt, prefix: list[int], plain_tok: int, spec_tok: int) -> dict:
    """The plain prefill's fp32 logits after ``prompt`` + ``prefix``: top-2 gap, plain's token minus the
    speculative run's token, their ranks, and the logits' standard deviation (the scale)."""
    r = eng.runner
    for s in range(r.num_slots):
        r.free(s)
    ids = torch.cat([prompt.input_ids.reshape(-1), torch.tensor(prefix, dtype=prompt.input_ids.dtype)])
    logits = r.prefill(0, PreparedPrompt(input_ids=ids)).float()
    r.free(0)
    top = logits.topk(2)
    order = logits.argsort(descending=True)
    rank = {int(t): i for i, t in enumerate(order[:1000].tolist())}
    return {"top2_gap": round(float(top.values[0] - top.values[1]), 5),
            "plain_minus_spec": round(float(logits[plain_tok] - logits[spec_tok]), 5),
            "prefill_argmax_is_plain": int(top.indices[0]) == plain_tok,
            "rank_plain": rank.get(plain_tok), "rank_spec": rank.get(spec_tok),
            "logit_std": round(float(logits.std()), 4)}


def profile_steps(eng: Engine, k: int, steps: int = 10) -> dict:
    """One stream after a 100-token prompt: ``steps`` decode steps (k = 0: plain; else speculative with k given
    drafts) under ``torch.profiler``.  Returns wall ms / kernels / GPU-busy ms per step and the top 12 rows."""
    from torch.profiler import ProfilerActivity, profile

    r, s = eng.runner, eng.sampler
    p = prompts(1, 100, seed=9)[0]
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0,
                            max_new_tokens=10 ** 6, stop_token_ids=())
    for slot in range(r.num_slots):
        r.free(slot)
    s.start(0, params)
    r.prefill(0, p)

    def step():
        if k:
            r.spec.decode(s, [0], [5], k, drafts=[[5] * k])
        else:
            s.sample_async([0], r.decode([0], torch.tensor([5])))

    cuda = r.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels)
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:12]
    r.free(0)
    return {"wall_ms_per_step": round(wall, 3), "kernels_per_step": round(len(kernels) / steps, 1),
            "gpu_busy_ms_per_step": round(busy_us / 1e3 / steps, 3),
            "top": [{"name": e.key[:90], "gpu_ms_per_step": round(e.device_time_total / 1e3 / steps, 3),
                     "calls_per_step": round(e.count / steps, 1),
                     "cpu_ms_per_step": round(e.cpu_time_total / 1e3 / steps, 3)} for e in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder; default: the random full-config checkpoint")
    ap.add_argument("--ckpt-dir", type=Path, default=Path("~/.cache/qwen_chat/serve_bench"))
    ap.add_argument("--out", type=Path, required=True, help="results prefix (PREFIX.json)")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from serve_bench import build_checkpoint

        model = str(build_checkpoint(args.ckpt_dir.expanduser())[0])
    cuda = torch.cuda.is_available()
    eng = Engine(model, "none", "cuda" if cuda else "cpu")
    doc: dict = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "model": model}

    def save():
        Path(str(args.out) + ".json").write_text(json.dumps({"spec_probe": doc}, indent=2))

    one = prompts(1, 100)
    for k in (1, 3):
        g = eng.runner.spec.verifier.graphs_for(k + 1)
        for ctx in eng.runner.context_buckets()[:2] if g is not None else ():
            g.capture_decode(k + 1, ctx)
        eng.run(one, 16, k)
    want, _, _ = eng.run(one, TOKENS)
    again, _, _ = eng.run(one, TOKENS)
    doc["plain_repeatable"] = want == again
    doc["plain_vs_plain_first_difference"] = first_difference(want[0], again[0])
    cont = {tuple(one[0].input_ids.tolist()): want[0]}
    doc["divergence"] = {}
    for k in (1, 3):
        got, tok_s, totals = eng.run(one, TOKENS, k, OracleDrafter(cont, 1.0, seed=k))
        i = first_difference(want[0], got[0])
        row = {"first_difference": i, "tok_s": round(tok_s, 1), "spec_steps": totals.get("spec_steps"),
               "drafted": totals.get("spec_drafted"), "accepted": totals.get("spec_accepted")}
        if i is not None and i < min(len(want[0]), len(got[0])):
            row.update(logit_gap(eng, one[0], want[0][:i], want[0][i], got[0][i]))
        doc["divergence"][str(k)] = row
        progress(f"K={k}: {row}")
        save()
    doc["profile"] = {}
    for k in (0, 1, 3):
        doc["profile"][str(k)] = profile_steps(eng, k)
        progress(f"profile K={k}: " + json.dumps({x: y for x, y in doc['profile'][str(k)].items() if x != 'top'}))
        save()
    for k, prof in doc["profile"].items():
        print(f"\n== K={k}: {prof['wall_ms_per_step']} ms/step wall, {prof['kernels_per_step']} kernels/step, "
              f"GPU busy {prof['gpu_busy_ms_per_step']} ms/step")
        for row in prof["top"]:
            print(f"  {row['gpu_ms_per_step']:8.3f} ms  {row['calls_per_step']:7.1f} x  cpu {row['cpu_ms_per_step']:8.3f}"
                  f"  {row['name']}")
    print("\nplain repeatable:", doc["plain_repeatable"], " first difference plain vs plain:",
          doc["plain_vs_plain_first_difference"])
    for k, row in doc["divergence"].items():
        print(f"K={k} oracle 1.0: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
