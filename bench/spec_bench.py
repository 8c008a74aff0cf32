"""Speculative decoding benchmark: the verify step's cost and the speed-up at simulated acceptance rates.

Usage (repository root; one GPU):

    python bench/spec_bench.py                      # random full-config checkpoint (bench/serve_ckpt.py, cached)
    python bench/spec_bench.py --model PATH         # an existing checkpoint folder instead
    python bench/spec_bench.py --quantize fp8       # FP8 weights (--quantize fp8 of the service)
    python bench/spec_bench.py --smoke              # CPU: the tiny model, everything scaled down

Random weights give the MTP head no skill (its drafts are almost never accepted), so the speed-up is measured
with **simulated acceptance** (``SimulatedDrafter``): each draft is "right" with probability ``rate``, and for the
verify step the target is made to agree with the right drafts by raising their logits at the verified positions
(``simulated_acceptance``, a wrapper of ``spec_sampling.accept_drafts`` in this process only) before the
engine's own acceptance runs.  A step then keeps its leading right drafts, exactly as a real draft run would,
and the state after it is that of the tokens kept (they are the drafts the verify fed).  The verify forward,
acceptance, state rollback, CUDA graphs, scheduler and speculation policy are the production ones
(``startup.runner_setup.build_runner`` builds them as the service does; no HTTP: the drafts enter through the
scheduler); only the text differs from the model's greedy reply (the kept drafts are random words).  Why not
recorded continuations: in bf16 a verify step's K + 1-row products round differently from a decode step's, and
with random weights the top-2 logits are often within a rounding step, so a reply drafted from plain
decoding's (or from its own previous run's) continuation leaves it after a few dozen tokens, and every later
draft counts as wrong (2026-12-03, H200: 8 rounds of re-drafting from its own reply did not settle K = 1).

Measured (tokens/s after each stream's first token, over ``--tokens`` generated tokens):

- ``oracle``: {rate: {K: {"batch1_tok_s", "speedup", "acceptance", "expected_acceptance"}}} for rates 0.6 / 0.85
  / 1.0 and K = 1..3, one stream; ``speedup`` is its tok/s over the plain run's; ``acceptance`` the kept share of
  the drafted tokens (scheduler totals), ``expected_acceptance`` its value when every step speculates:
  (r + r^2 + ... + r^K) / K, the mean leading run of right drafts over K.  They differ when the speculation
  policy pauses a sequence after a run of rejections (``core.spec_policy``): its speculative steps then end on
  rejections more often than the draws would, so over the few dozen steps of one reply the kept share falls below
  the draw rate (2026-12-03, CPU, rate 0.6, K = 1: 9 of 23 steps kept, the pauses after the 17th and 23rd);
  at rate 1.0 every draft must be kept (``acceptance_off`` lists runs where not);
- ``oracle_batch``: {"32" | "128": tok/s ratio vs plain}: as many streams at once, rate 0.85, K = 1 (with the
  default ``--speculative-max-batch`` these batches decode plainly: the ratio shows the cost of the checks);
- ``random_head``: {"1" | "32" | "128": tok/s ratio vs plain}: the checkpoint's own MTP head drafting (K = 1; its
  replies must equal plain decoding's in fp32, ``differs_from_plain``);
- ``verify_cost_ms``: {"plain": ms of one plain decode step, "1" | "2" | "3": ms of one speculative step with
  K given drafts (verify forward, acceptance, state rollback)}, one stream, median of 20; ``mtp_step_ms``: the
  same with the MTP head drafting (its pass over the kept positions and K lm_head reads included).

Writes ``bench/results/<date>-<gpu>-speculative.json`` (key ``speculative``; ``--out PREFIX`` overrides the
prefix; ``--smoke`` writes ``<date>-cpu-speculative-smoke.json``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import random
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from qwen_chat.chat_types import CancelToken  # noqa: E402
from qwen_chat.config import ServiceConfig  # noqa: E402
from qwen_chat.engine.core.scheduler import Scheduler  # noqa: E402
from qwen_chat.engine.parallel.executors import LocalExecutor  # noqa: E402
from qwen_chat.engine.model import spec_step  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt, SamplingParams  # noqa: E402

RATES = ("0.6", "0.85", "1.0")
KS = (1, 2, 3)
FULL = dict(tokens=512, prompt=100, batches=(32, 128), batch_tokens=128, repeats=20)
SMOKE = dict(tokens=24, prompt=16, batches=(4,), batch_tokens=8, repeats=3)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompts(n: int, length: int, seed: int = 0) -> list[PreparedPrompt]:
    """n random prompts of ``length`` text token ids (the first 150,000 ids: plain words of the vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    return [PreparedPrompt(input_ids=torch.randint(0, 150_000, (length,), generator=gen)) for _ in range(n)]


class Engine:
    """The production runner and sampler (``build_runner``: the memory budget, CUDA graphs, the MTP head)."""

    def __init__(self, model: str, quantize: str, device: str) -> None:
        from qwen_chat.engine.checkpoints.fp8_loading import quantize_model
        from qwen_chat.engine.checkpoints.loading import load_model, resolve_checkpoint
        from qwen_chat.engine.startup.runner_setup import build_runner

        # the budget plans the snapshots of K = 3 only; 0.7 leaves room for those of K = 1 and 2 (1.1 GiB more)
        # and for warming the verify graphs up after the decode graphs (4.8 GiB asked for at 0.85 on an H200)
        argv = ["--model", model, "--speculative-tokens", str(max(KS)), "--device", device,
                "--gpu-memory-utilization", "0.7"]
        self.cfg = ServiceConfig.from_argv(argv).validate()
        path = resolve_checkpoint(model)
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.loaded = load_model(path, device, dtype=dtype, place_on_device=quantize != "fp8")
        if quantize == "fp8":
            quantize_model(self.loaded.model, device=torch.device(device))
        self.runner, self.sampler, self.plan, _ = build_runner(self.loaded, self.cfg)

    def run(self, ps: list[PreparedPrompt], tokens: int, k: int = 0, drafter=None):
        """Greedy replies of ``ps`` sent at once: (replies, decode tok/s (one stream: after its first token;
        several: all tokens after the last first token over the time since), scheduler totals)."""
        n = len(ps)
        for s in range(self.runner.num_slots):
            self.runner.free(s)
        sched = Scheduler(LocalExecutor(self.runner, self.sampler), num_slots=self.runner.num_slots,
                          max_queue=max(n, 1), eos_ids=(), max_context=self.runner.max_context,
                          num_blocks=self.runner.num_blocks, block_tokens=self.runner.block_tokens,
                          prefill_token_budget=8192, overlap=True, speculative_tokens=k, drafter=drafter,
                          speculative_max_batch=self.cfg.speculative_max_batch)
        sampling = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0,
                                  max_new_tokens=tokens, stop_token_ids=())
        try:
            handles = [sched.submit(p, sampling, CancelToken()) for p in ps]
            out = [[] for _ in ps]
            stamps = [[] for _ in ps]

            def read(i):
                for t in handles[i]:
                    out[i].append(t)
                    stamps[i].append(time.perf_counter())

            threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            start = max(s[0] for s in stamps)
            end = max(s[-1] for s in stamps)
            after = sum(sum(1 for x in s if x > start) for s in stamps)
            return out, after / max(end - start, 1e-9), sched.stats()["totals"]
        finally:
            sched.shutdown()

    def step_cost(self, repeats: int, mtp: bool = False) -> dict:
        """Median ms of one plain decode step and of one speculative step with K drafts (one stream,
        ``Speculation.step_time``): drafts given (the verify forward, acceptance and state rollback), or ``mtp``:
        drafted by the MTP head."""
        r = self.runner
        p = prompts(1, 100, seed=9)[0]
        out = {}
        for k in ((0,) if not mtp else ()) + KS:
            for slot in range(r.num_slots):
                r.free(slot)
            t = r.spec.step_time(self.sampler, k, given=not mtp, steps=repeats, warmup=3, prompt=p)
            out[str(k) if k else "plain"] = round(t * 1e3, 3)
        return out


RIGHT_IDS = 100_000  # simulated drafts: ids below are "right", ids from here to WRONG_END "wrong"
WRONG_END = 150_000
RAISED = 1.0e4       # logit given to a right draft: above any logit of the model (fp32)


class SimulatedDrafter:
    """The scheduler's ``drafter(request, k) -> k ids`` for simulated acceptance: each draft is right with
    probability ``rate`` (a random id below ``RIGHT_IDS``), else wrong (an id in [RIGHT_IDS, WRONG_END)); seeded."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        self.rate, self._rng = float(rate), random.Random(seed)

    def __call__(self, req, k: int) -> list[int]:
        r = self._rng
        return [r.randrange(RIGHT_IDS) if r.random() < self.rate else r.randrange(RIGHT_IDS, WRONG_END)
                for _ in range(k)]


@contextlib.contextmanager
def simulated_acceptance():
    """While open, the engine's speculative steps (``spec_step.accept_drafts``) see the verify logits with each
    right draft's (id < ``RIGHT_IDS``) logit raised to ``RAISED`` at its position, so greedy acceptance keeps the
    leading right drafts and nothing else changes (the raised copy is fp32 [B, K + 1, V], as the verify's)."""
    real = spec_step.accept_drafts

    def accept(sampler, slots, logits, drafts):
        drafts = drafts.to(logits.device, torch.long)
        raised = logits.clone()
        rows = raised[:, :-1, :]                                            # [B, K, V]: the drafts' positions
        at = drafts[..., None]
        rows.scatter_(2, at, torch.where(at < RIGHT_IDS, RAISED, rows.gather(2, at)))
        return real(sampler, slots, raised, drafts)

    spec_step.accept_drafts = accept
    try:
        yield
    finally:
        spec_step.accept_drafts = real


def expected_acceptance(rate: float, k: int) -> float:
    """Kept share of K drafts per step when each is right with probability ``rate``: (r + ... + r^K) / K."""
    return sum(rate ** j for j in range(1, k + 1)) / k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (or 'tiny'); default: the random full-config checkpoint")
    ap.add_argument("--ckpt-dir", type=Path, default=Path("~/.cache/qwen_chat/serve_bench"),
                    help="cache folder of the random checkpoint (bench/serve_ckpt.py)")
    ap.add_argument("--quantize", default="none", choices=("none", "fp8"))
    ap.add_argument("--smoke", action="store_true", help="the tiny model on CPU, everything scaled down")
    ap.add_argument("--out", type=Path, help="results prefix (default bench/results/<date>-<gpu>-speculative)")
    args = ap.parse_args(argv)
    size = SMOKE if args.smoke else FULL
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    model = args.model or ("tiny" if args.smoke else None)
    if model is None:
        from serve_bench import build_checkpoint

        progress("building / finding the random full-config checkpoint")
        model = str(build_checkpoint(args.ckpt_dir.expanduser())[0])
    gpu = torch.cuda.get_device_name().replace(" ", "-") if device == "cuda" else "cpu"
    prefix = args.out or ROOT / "bench" / "results" / (
        f"{dt.date.today():%F}-{gpu}-speculative" + ("-smoke" if args.smoke else ""))
    progress(f"loading {model} on {device}")
    eng = Engine(model, args.quantize, device)
    result = {"gpu": gpu, "model": model, "quantize": args.quantize, "simulated": "each draft right with "
              "probability rate; the verify logits of right drafts raised so the target keeps them (bench/spec_bench.py)", "tokens": size["tokens"],
              "speculative_max_batch": eng.cfg.speculative_max_batch}
    doc = {"speculative": result}

    def save():
        Path(str(prefix) + ".json").write_text(json.dumps(doc, indent=2))

    one = prompts(1, size["prompt"])
    for k in KS:  # the verify graphs of every K for one stream (the service captures only its K at start-up)
        g = eng.runner.spec.verifier.graphs_for(k + 1)
        for ctx in eng.runner.context_buckets()[:2] if g is not None else ():
            g.capture_decode(k + 1, ctx)
        eng.run(one, 16, k)
    want, plain_tok_s, _ = eng.run(one, size["tokens"])  # first run: warms the shapes up
    want, plain_tok_s, _ = eng.run(one, size["tokens"])
    result["plain_batch1_tok_s"] = round(plain_tok_s, 1)
    progress(f"plain batch 1: {plain_tok_s:.1f} tok/s")
    result["oracle"] = {}
    off = []  # runs at rate 1.0 that did not keep every draft
    for rate in RATES:
        result["oracle"][rate] = {}
        for k in KS:
            with simulated_acceptance():
                _, tok_s, totals = eng.run(one, size["tokens"], k, SimulatedDrafter(float(rate), seed=k))
            acc = totals["spec_accepted"] / max(totals["spec_drafted"], 1)
            want_acc = expected_acceptance(float(rate), k)
            if rate == "1.0" and acc != 1.0:  # lower rates: the policy's pauses select the steps (module doc)
                off.append(f"oracle {rate} K={k}")
            result["oracle"][rate][str(k)] = {"batch1_tok_s": round(tok_s, 1), "speedup": round(tok_s / plain_tok_s, 3),
                                              "acceptance": round(acc, 3), "expected_acceptance": round(want_acc, 3)}
            progress(f"oracle rate {rate} K={k}: {tok_s:.1f} tok/s ({tok_s / plain_tok_s:.2f}x, acceptance {acc:.2f}"
                     f" of {want_acc:.2f} expected)")
            save()
    differs = []  # MTP-head replies that left plain decoding's: expected none in fp32 (CPU)
    result["random_head"], result["oracle_batch"] = {}, {}
    got, tok_s, _ = eng.run(one, size["tokens"], 1)
    result["random_head"]["1"] = round(tok_s / plain_tok_s, 3)
    differs += [] if got == want else ["random head batch 1"]
    for n in size["batches"]:
        if n > eng.runner.num_slots:
            progress(f"{n} streams: the memory budget holds {eng.runner.num_slots} slots; skipped")
            continue
        ps = prompts(n, size["prompt"], seed=n)
        base, base_tok_s, _ = eng.run(ps, size["batch_tokens"])
        got, tok_s, _ = eng.run(ps, size["batch_tokens"], 1)
        result["random_head"][str(n)] = round(tok_s / base_tok_s, 3)
        differs += [] if got == base else [f"random head {n} streams"]
        with simulated_acceptance():
            _, tok_s, _ = eng.run(ps, size["batch_tokens"], 1, SimulatedDrafter(0.85, seed=n))
        result["oracle_batch"][str(n)] = round(tok_s / base_tok_s, 3)
        progress(f"{n} streams: plain {base_tok_s:.0f} tok/s, random head x{result['random_head'][str(n)]}, "
                 f"oracle 0.85 x{result['oracle_batch'][str(n)]}")
        save()
    result["verify_cost_ms"] = eng.step_cost(size["repeats"])
    result["mtp_step_ms"] = eng.step_cost(size["repeats"], mtp=True)
    result["acceptance_off"] = off
    result["differs_from_plain"] = differs  # expected empty in fp32 (CPU); bf16 rounding may differ on a GPU
    save()
    print(json.dumps(doc, indent=2))
    return 0 if not off and not (device == "cpu" and differs) else 1


if __name__ == "__main__":
    sys.exit(main())
