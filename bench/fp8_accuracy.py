"""Accuracy of FP8 weights against an fp32 reference: the full published Qwen3.5-9B config with random weights.

Usage (one GPU host with >= 60 GB, repository root; about 3-5 minutes on an H200):

    python bench/fp8_accuracy.py                  # writes bench/results/<date>-<gpu>-fp8-accuracy.json (and $OUT/)
    python bench/fp8_accuracy.py --smoke          # a small config on CPU: checks the script, numbers meaningless
    python bench/fp8_accuracy.py --quantize int4  # the same with 4-bit weights (--quantize int4) in FP8's place:
                                                  # ...-int4-accuracy.json, runs named "engine int4"
    python bench/fp8_accuracy.py --quantize kv-fp8  # bf16 weights with an FP8 KV cache (--kv-cache-dtype fp8)
                                                  # in FP8's place: ...-kv-fp8-accuracy.json, "engine bf16, fp8 KV"

Two prompts, a text one (96 random tokens) and an image one (a 448 x 448 random-pixel image between short texts,
196 visual tokens).  The fp32 reference is transformers' model in fp32 with its PyTorch reference kernels and no
TF32 (``loading.torch_reference_kernels``); its greedy continuation of 32 tokens is the teacher-forced input of
every run, so each run's logits are compared at the same 33 positions (the prompt's last token, then each fed
token).  Per position: relative error max |x - ref| / max |ref| over the vocabulary, and whether the top-1 token
agrees; reported as the median (and max) over positions and the agreement rate, per prompt.

Runs: the engine (``ModelRunner``, production options: CUDA graphs, compiled glue, Triton GEMVs; each prompt
alone, batch 1) in fp32, bf16 and FP8 (``--quantize fp8``'s ``quantize_model`` on the bf16 weights); then the
bf16 and FP8 runs' logits once more against an fp32 reference on the weights as that run had them (bf16
values, FP8 layers dequantised), which separates the error of the computation from the rounding of the weights
(random weights amplify any weight perturbation: bf16's own rounding already moves the logits by about 7%);
transformers in bf16 (its default kernels, as a user runs it) and in fp32 with its default kernels (fla's
Triton kernels round fp32 to TF32 in ``tl.dot``: what an fp32 comparison used to measure).  Targets: engine fp32
<= 1e-4 (median and max); FP8's median error <= 1.5 x the engine bf16's and its top-1 agreement >= bf16's - 5
points (with ``--quantize int4`` only the top-1 and the own-weights comparison are targets: 4-bit rounding of
random weights moves the logits far more than bf16's, which is reported; with ``--quantize kv-fp8`` the bf16
engine on an FP8 KV cache against the same fp32 reference on the bf16 weights as the bf16 cache's run, target:
its median error <= 1.2 x the bf16 cache's).  JSON after each run; the table is printed last.
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
sys.path.insert(0, str(ROOT / "bench"))

from decode_bench import build_config, image_prompt, random_ids  # noqa: E402

from qwen_chat.engine.checkpoints import fp8_loading, int4_loading  # noqa: E402
from qwen_chat.engine.checkpoints.loading import torch_reference_kernels  # noqa: E402
from qwen_chat.engine.model import kv_quant  # noqa: E402
from qwen_chat.engine.model.fp8 import weights_report  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt  # noqa: E402

STEPS = 32
#: The run of the bf16 engine on an FP8 KV cache (``--quantize kv-fp8``).
KV_RUN = "engine bf16, fp8 KV"


def forced(prompt: PreparedPrompt, tokens: list[int]) -> dict:
    """transformers inputs of ``prompt`` followed by ``tokens`` (batch 1)."""
    ids = torch.cat([prompt.input_ids, torch.tensor(tokens, dtype=torch.long)])[None]
    kw = dict(input_ids=ids)
    if prompt.pixel_values is not None:
        mm = torch.cat([prompt.mm_token_type_ids, torch.zeros(len(tokens), dtype=torch.long)])[None]
        kw.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=mm)
    return kw


@torch.no_grad()
def transformers_logits(model, prompt: PreparedPrompt, tokens: list[int], dev) -> torch.Tensor:
    """fp32 logits [len(tokens) + 1, V] at the prompt's last position and after each of ``tokens`` (one forward)."""
    kw = {k: v.to(dev) for k, v in forced(prompt, tokens).items()}
    n = prompt.num_tokens
    return model(**kw).logits[0, n - 1:n + len(tokens)].float()


@torch.no_grad()
def greedy_tokens(model, prompt: PreparedPrompt, steps: int, dev) -> list[int]:
    """The model's greedy continuation of ``prompt`` (one full forward per token: no cache to get wrong)."""
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(transformers_logits(model, prompt, tokens, dev)[-1].argmax()))
    return tokens


@torch.no_grad()
def engine_logits(runner: ModelRunner, prompt: PreparedPrompt, tokens: list[int]) -> torch.Tensor:
    """The engine's fp32 logits [len(tokens) + 1, V]: prefill into slot 0, then one decode step per fed token
    (batch 1, the service's single-stream path)."""
    runner.free(0)
    rows = [runner.prefill(0, prompt)]
    for t in tokens:
        rows.append(runner.decode([0], torch.tensor([t], device=runner.device))[0])
    runner.free(0)
    return torch.stack(rows).float()


def dequantize_to_linear(model) -> None:
    """Replace every ``Fp8Linear`` / ``Int4Linear`` of ``model`` by a bias-free ``nn.Linear`` holding its
    dequantised weight (fp32)."""
    from qwen_chat.engine.model.fp8 import Fp8Linear
    from qwen_chat.engine.model.int4 import Int4Linear

    for name, m in list(model.named_modules()):
        if isinstance(m, (Fp8Linear, Int4Linear)):
            w = m.fp8_weight() if isinstance(m, Fp8Linear) else m.int4_weight()
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=False, device=w.device)
            with torch.no_grad():
                lin.weight.copy_(w.dequantize(torch.float32))
            model.set_submodule(name, lin)


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-position relative error (max |x - ref| / max |ref|) and top-1 agreement against ``ref`` [P, V]."""
    rel = ((x.to(ref.device) - ref).abs().amax(-1) / ref.abs().amax(-1)).tolist()
    top1 = (x.to(ref.device).argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"rel_err_median": statistics.median(rel), "rel_err_max": max(rel), "top1_agreement": top1,
            "rel_err_per_position": rel}


def table(doc: dict) -> str:
    lines = [f"{'run':<52} {'prompt':<6} {'median rel err':>15} {'max rel err':>12} {'top-1':>7}"]
    for run, by_prompt in doc["runs"].items():
        for name, r in by_prompt.items():
            if isinstance(r, dict) and "rel_err_median" in r:
                lines.append(f"{run:<52} {name:<6} {r['rel_err_median']:>15.3e} {r['rel_err_max']:>12.3e} "
                             f"{r['top1_agreement'] * 100:>6.1f}%")
    for name, value in doc.get("targets", {}).items():
        lines.append(f"target {name:<60} {'met' if value else 'NOT MET'}")
    for name in doc["errors"]:
        lines.append(f"FAILED: {name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small config on CPU (checks the script only)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quantize", choices=("fp8", "int4", "kv-fp8"), default="fp8",
                    help="the quantised weights (or kv-fp8: the FP8 KV cache on bf16 weights) compared")
    args = ap.parse_args(argv)
    q = args.quantize
    dev = torch.device("cpu" if args.smoke else "cuda")
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name(dev).replace(" ", "-")
    stem = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}-{gpu}-{q}-accuracy" + ("-smoke" if args.smoke else "")
    paths = [args.out / f"{stem}.json"] + ([Path(os.environ["OUT"]) / f"{stem}.json"] if os.environ.get("OUT") else [])
    import transformers

    doc = {"env": {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "command": " ".join(["python", "bench/fp8_accuracy.py"] + (argv or sys.argv[1:])), "quantize": q},
           "runs": {}, "errors": {}}

    def save():
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(doc, indent=1))

    def run(name, fn):
        t = time.perf_counter()
        try:
            doc["runs"][name] = fn()
            status = "ok"
        except Exception as exc:  # record and go on: one failed run must not lose the others
            doc["errors"][name] = "".join(traceback.format_exception(exc))[-3000:]
            status = f"FAILED: {exc!r}"[:300]
        print(f"[{time.perf_counter() - t:7.1f} s] {name}: {status}", flush=True)
        save()

    config = build_config(args.smoke)
    gen = torch.Generator().manual_seed(0)
    side = 64 if args.smoke else 448
    prompts = {"text": PreparedPrompt(input_ids=random_ids(24 if args.smoke else 96, gen)),
               "image": image_prompt(config, gen, side)}
    steps = 4 if args.smoke else STEPS
    max_context = max(p.num_tokens for p in prompts.values()) + steps + 64
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3_5ForConditionalGeneration(config).eval()  # fp32, random (the config's initialiser)
    doc["model"] = {"parameters": sum(p.numel() for p in model.parameters()), "prompt_tokens":
                    {k: p.num_tokens for k, p in prompts.items()}, "positions": steps + 1}
    ref, tokens = {}, {}
    with torch_reference_kernels():
        for name, p in prompts.items():
            tokens[name] = greedy_tokens(model, p, steps, dev)
            ref[name] = transformers_logits(model, p, tokens[name], dev)
    doc["teacher_tokens"] = tokens

    def each(fn):
        return {name: compare(fn(p, tokens[name]), ref[name]) for name, p in prompts.items()}

    kept = {}  # run name -> {prompt: logits}, for the comparisons against references on rounded weights

    def engine(keep=None, kv_dtype=None):
        runner = ModelRunner(model, num_slots=1, max_context=max_context, device=dev, kv_dtype=kv_dtype)
        out = {}
        for name, p in prompts.items():
            x = engine_logits(runner, p, tokens[name])
            if keep is not None:
                kept.setdefault(keep, {})[name] = x.cpu()
            out[name] = compare(x, ref[name])
        out["impl"] = runner.impl
        return out

    def rounded_reference(run_name):
        """fp32 reference (exact kernels) on the weights as the run had them (bf16 values, or the FP8 layers
        dequantised), against that run's kept logits: the error of its computation alone, without the
        rounding of the weights."""
        with torch_reference_kernels():
            refs = {name: transformers_logits(model, p, tokens[name], dev) for name, p in prompts.items()}
        return {name: compare(kept[run_name][name], refs[name]) for name in prompts}

    run("engine fp32", engine)
    run("transformers fp32 (default kernels)", lambda: each(lambda p, t: transformers_logits(model, p, t, dev)))
    model.to(torch.bfloat16)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    run("transformers bf16", lambda: each(lambda p, t: transformers_logits(model, p, t, dev)))
    run("engine bf16", lambda: engine("engine bf16"))
    if q == "kv-fp8":  # the same bf16 weights and engine on an FP8 KV cache
        run(KV_RUN, lambda: engine(KV_RUN, kv_dtype=kv_quant.FP8))
    if "engine bf16" in kept:  # fp32 compute on the bf16 values (the round trip bf16 -> fp32 -> bf16 is exact)
        model.float()
        run("engine bf16 vs fp32 on its own weights", lambda: rounded_reference("engine bf16"))
        if KV_RUN in kept:  # the FP8 cache's run had the same weights: the same reference
            run(f"{KV_RUN} vs fp32 on its own weights", lambda: rounded_reference(KV_RUN))
        model.to(torch.bfloat16)
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    def finish() -> int:
        save()
        print(table(doc))
        return 0 if not doc["errors"] else 1

    if q == "kv-fp8":
        doc["targets"] = kv_fp8_targets(doc["runs"], prompts)
        return finish()
    (fp8_loading if q == "fp8" else int4_loading).quantize_model(model, device=dev)
    doc[f"{q}_weights"] = weights_report(model)
    run(f"engine {q}", lambda: engine(f"engine {q}"))
    if f"engine {q}" in kept:  # fp32 compute on the dequantised layers and the bf16 rest; last (fp32 model)
        dequantize_to_linear(model)
        model.float()
        run(f"engine {q} vs fp32 on its own weights", lambda: rounded_reference(f"engine {q}"))
    runs = doc["runs"]
    if all(k in runs for k in ("engine fp32", "engine bf16", f"engine {q}")):
        doc["targets"] = {
            "engine fp32 within 1e-4 of the fp32 reference (max over positions)":
                all(runs["engine fp32"][p]["rel_err_max"] <= 1e-4 for p in prompts),
            f"{q} median rel err <= 1.5 x engine bf16's":
                all(runs[f"engine {q}"][p]["rel_err_median"] <= 1.5 * runs["engine bf16"][p]["rel_err_median"]
                    for p in prompts),
            f"{q} top-1 agreement >= engine bf16's - 5 points":
                all(runs[f"engine {q}"][p]["top1_agreement"] >= runs["engine bf16"][p]["top1_agreement"] - 0.05
                    for p in prompts)}
        if q == "int4":  # 4-bit rounding of random weights moves the logits far more than bf16's: reported only
            del doc["targets"][f"{q} median rel err <= 1.5 x engine bf16's"]
        own = (f"engine {q} vs fp32 on its own weights", "engine bf16 vs fp32 on its own weights")
        if all(k in runs for k in own):
            doc["targets"][f"(on each run's own weights) {q} median rel err <= 1.5 x bf16's"] = all(
                runs[own[0]][p]["rel_err_median"] <= 1.5 * runs[own[1]][p]["rel_err_median"] for p in prompts)
    return finish()


def kv_fp8_targets(runs: dict, prompts: dict) -> dict:
    """The ``--quantize kv-fp8`` targets (empty until both runs against the fp32 reference on the bf16 weights
    are in ``runs``): the FP8 cache's median error within 1.2 x the bf16 cache's, its top-1 agreement within 5
    points of the bf16 cache's."""
    own = (f"{KV_RUN} vs fp32 on its own weights", "engine bf16 vs fp32 on its own weights")
    if not all(k in runs for k in own):
        return {}
    return {"(on the bf16 weights) fp8 KV median rel err <= 1.2 x bf16 KV's": all(
                runs[own[0]][p]["rel_err_median"] <= 1.2 * runs[own[1]][p]["rel_err_median"] for p in prompts),
            "fp8 KV top-1 agreement >= bf16 KV's - 5 points": all(
                runs[own[0]][p]["top1_agreement"] >= runs[own[1]][p]["top1_agreement"] - 0.05 for p in prompts)}


if __name__ == "__main__":
    sys.exit(main())
