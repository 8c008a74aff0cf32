"""Where an fp32 engine run on CUDA leaves exact fp32: the engine's prefill and first decode step against
transformers' exact fp32 (``loading.torch_reference_kernels``) on models of the full widths with only one layer
kind (7 Gated DeltaNet layers and one full attention (transformers needs one), 8 full-attention
layers, the published mix of 8), text prompt of 96 tokens.

Usage (one GPU host, repository root; about a minute on an H200):  python bench/fp32_probe.py
Prints one line per model: relative error (max |x - ref| / max |ref|) of the prefill's last logits and of one
decode step; writes $OUT/fp32-probe.json when $OUT is set.  On CPU the same comparison agrees to ~1e-6.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen_chat.engine.checkpoints.loading import torch_reference_kernels  # noqa: E402
from qwen_chat.engine.model.runner import ModelRunner  # noqa: E402
from qwen_chat.engine.types import PreparedPrompt  # noqa: E402


def rel(x, ref):
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def one(kinds: list[str], dev: str) -> dict:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    raw = json.loads((ROOT / "bench" / "qwen3_5_9b_config.json").read_text())
    tc = raw["text_config"]
    tc.update(num_hidden_layers=len(kinds), layer_types=kinds, vocab_size=32000)
    raw["vision_config"]["depth"] = 1
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**raw)).eval()
    ids = torch.randint(0, 32000, (96,), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch_reference_kernels(), torch.no_grad():
        ref = model(input_ids=ids[None].to(dev)).logits[0, -1]
        runner = ModelRunner(model, num_slots=1, max_context=256, device=dev)
        out["prefill"] = rel(runner.prefill(0, PreparedPrompt(input_ids=ids)), ref)
        tok = int(ref.argmax())
        ref2 = model(input_ids=torch.cat([ids, torch.tensor([tok])])[None].to(dev)).logits[0, -1]
        out["decode"] = rel(runner.decode([0], torch.tensor([tok], device=dev))[0], ref2)
        out["impl"] = runner.impl
    del model, runner
    torch.cuda.empty_cache() if dev == "cuda" else None
    return out


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {}
    for name, kinds in (("7 linear + 1 full", ["linear_attention"] * 7 + ["full_attention"]), ("full attention only", ["full_attention"] * 8),
                        ("published mix", (["linear_attention"] * 3 + ["full_attention"]) * 2)):
        t = time.perf_counter()
        res[name] = one(kinds, dev)
        print(f"{name:20s} prefill {res[name]['prefill']:.2e}  decode {res[name]['decode']:.2e}  "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    import transformers

    doc = {"env": {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": dev,
                   "gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "torch": torch.__version__,
                   "transformers": transformers.__version__, "command": "python bench/fp32_probe.py",
                   "layers": 8, "vocab": 32000, "prompt_tokens": 96}, "runs": res}
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "fp32-probe.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
