"""Programmatic dependent launch (``RunnerOptions.pdl``) on and off: decode speed and bitwise equality of the
logits, on the full published Qwen3.5-9B config with random weights, bf16 and FP8 (``--quantize fp8``'s
``quantize_model``).

Usage (one GPU host of compute capability >= 9.0, repository root; about 4 minutes on an H200):

    python bench/pdl_probe.py            # writes bench/results/<date>-<gpu>-pdl-probe.json (and $OUT/)
    python bench/pdl_probe.py --smoke    # tiny config on CPU ("off" only: PDL needs Hopper): checks the script

For each weight kind and each variant ("off": no PDL; "kernels": the engine's Triton kernels launched with PDL,
the compiled glue without; "on": both, what ``RunnerOptions()`` resolves to on Hopper) a runner is built (CUDA
graphs, compiled glue, Triton GEMVs) and measured:
- equality: the logits of a 256-token prompt's prefill and 24 greedy decode steps against the "off" runner's
  (max |difference|, expected 0: PDL changes when kernels start, not what they compute), and the greedy tokens;
- speed: batch-1 and batch-4 decode as the scheduler pipelines it (``decode_bench.engine_decode``: 512-token
  prompts, 256 steps, sampling), the median of 3 runs, and the GPU kernel time of a batch-1 step
  (``decode_bench.profile_decode``: the kernels' sum against the step's wall time shows the gaps PDL closes).
The table is printed last.
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

from decode_bench import build_config, engine_decode, profile_decode, random_ids, sync  # noqa: E402

from qwen_chat.engine.model import glue, pdl  # noqa: E402
from qwen_chat.engine.model.options import RunnerOptions  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner  # noqa: E402
from qwen_chat.engine.model.sampling import Sampler  # noqa: E402
from qwen_chat.engine.serving.requests import PreparedPrompt  # noqa: E402

VARIANTS = ("off", "kernels", "on")


def build_runner(model, dev, variant: str, max_context: int):
    """A production runner with PDL as ``variant`` says ("kernels": Inductor's switch withheld from the glue)."""
    torch._dynamo.reset()
    withheld = glue.inductor_options
    if variant == "kernels":
        glue.inductor_options = lambda flag: {}
    try:
        runner = ModelRunner(model, num_slots=4, max_context=max_context, device=dev,
                             options=RunnerOptions(pdl=variant != "off"))
    finally:
        glue.inductor_options = withheld
    runner.capture_all([1, 4], [runner.context_bucket(max_context)])
    return runner


def greedy_logits(runner, dev, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """fp32 logits [steps + 1, V] of ``prompt``'s prefill then ``steps`` greedy decode steps (slot 0)."""
    runner.free(0)
    out = [runner.prefill(0, PreparedPrompt(input_ids=prompt))]
    for _ in range(steps):
        out.append(runner.decode([0], out[-1].argmax()[None].to(dev))[0])
    runner.free(0)
    return torch.stack(out).float().cpu()


def measure(runner, sampler, dev, sizes: dict, gen) -> dict:
    res = {}
    for batch in (1, 4):
        runs = [engine_decode(runner, sampler, dev, batch, sizes["prompt"], sizes["new"], gen) for _ in range(3)]
        res[f"b{batch}_tok_s"] = statistics.median(r["aggregate_tok_s"] for r in runs)
        res[f"b{batch}_runs_tok_s"] = [r["aggregate_tok_s"] for r in runs]
        res[f"b{batch}_step_ms"] = statistics.median(r["mean_step_ms"] for r in runs)
    if dev.type == "cuda":
        prof = profile_decode(runner, dev, 1, sizes["prompt"], 5, gen)
        res["b1_kernel_ms_per_step"] = prof["kernel_ms_per_step"]
        res["b1_kernels_per_step"] = prof["kernels_per_step"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (checks the script only)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke else "cuda")
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name(dev).replace(" ", "-")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    name = f"{stamp}-{gpu}-pdl-probe" + ("-smoke" if args.smoke else "") + ".json"
    paths = [args.out / name] + ([Path(os.environ["OUT"]) / name] if os.environ.get("OUT") else [])
    import transformers
    import triton

    doc = {"env": {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
                   "torch": torch.__version__, "triton": triton.__version__,
                   "transformers": transformers.__version__, "inductor_pdl": bool(pdl.inductor_options(True)),
                   "command": " ".join(["python", "bench/pdl_probe.py"] + (argv if argv is not None else sys.argv[1:]))},
           "results": {}, "errors": {}}
    sizes = dict(prompt=512, new=257, check_prompt=256, check_steps=24, max_context=1024)
    if args.smoke:
        sizes.update(prompt=16, new=4, check_prompt=12, check_steps=3, max_context=64)
    variants = VARIANTS if pdl.supported(dev) else ("off",)
    gen = torch.Generator().manual_seed(0)
    check_prompt = random_ids(sizes["check_prompt"], gen)

    def save():
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(doc, indent=1, default=str))

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        from transformers import Qwen3_5ForConditionalGeneration

        with torch.device(dev):
            model = Qwen3_5ForConditionalGeneration(build_config(args.smoke)).eval()
    finally:
        torch.set_default_dtype(old)
    for kind in ("bf16", "fp8"):
        if kind == "fp8":
            from qwen_chat.engine.checkpoints.fp8_loading import quantize_model

            quantize_model(model, device=dev)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        reference = None
        for variant in variants:
            key = f"{kind}/{variant}"
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    runner = build_runner(model, dev, variant, sizes["max_context"])
                    sampler = Sampler(runner.num_slots, runner.vocab_size, dev)
                    sampler.warm_up()
                    logits = greedy_logits(runner, dev, check_prompt, sizes["check_steps"])
                    if reference is None:
                        reference = logits
                    row = {"impl_pdl": runner.impl["programmatic_dependent_launch"],
                           "logits_max_abs_diff_vs_off": float((logits - reference).abs().max()),
                           "greedy_tokens_equal_off": bool(torch.equal(logits.argmax(-1), reference.argmax(-1)))}
                    row.update(measure(runner, sampler, dev, sizes, gen))
                doc["results"][key] = row
                status = "ok"
            except Exception as exc:  # record and go on: the other variants still tell something
                doc["errors"][key] = "".join(traceback.format_exception(exc))[-3000:]
                status = f"FAILED: {exc!r}"[:300]
            runner = sampler = None
            sync(dev)
            print(f"[{time.perf_counter() - t0:6.1f} s] {key}: {status}", flush=True)
            save()
    print(f"\n{'weights/variant':<16} {'b1 tok/s':>9} {'b1 ms':>7} {'kern ms':>8} {'kernels':>8} {'b4 tok/s':>9} "
          f"{'max|dlogit|':>11} {'tokens':>7}")
    for key, r in doc["results"].items():
        print(f"{key:<16} {r['b1_tok_s']:>9.1f} {r['b1_step_ms']:>7.3f} {r.get('b1_kernel_ms_per_step', 0):>8.3f} "
              f"{r.get('b1_kernels_per_step', 0):>8.0f} {r['b4_tok_s']:>9.1f} {r['logits_max_abs_diff_vs_off']:>11.3g} "
              f"{'same' if r['greedy_tokens_equal_off'] else 'DIFFER':>7}")
    for key, err in doc["errors"].items():
        print(f"{key}: {err.splitlines()[-1]}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
