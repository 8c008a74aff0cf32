"""Speculative decoding through the Gated DeltaNet Triton kernel under Triton's interpreter (CPU), run as
``TRITON_INTERPRET=1 python -m tests.support.spec_triton_check`` (the variable must be set before the kernels
are defined; ``tests/engine/test_speculative.py`` does).  Prints one JSON line: the greedy tokens of plain
decoding and of speculative steps (k = 2, oracle drafts with every third one wrong) on the small random
Qwen3.5 with ``RunnerOptions(gdn_kernel=True)``, and the runner's ``gdn_decode`` implementation."""
from __future__ import annotations

import json
import os

import torch

from qwen_chat.engine.model import spec_step
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.types import PrefillItem, PreparedPrompt, SamplingParams, StepPlan
from tests.support.small_model import small_model

N = 16


def greedy(ex, prompt, k=0, want=None):
    """N greedy tokens: plain steps, or speculative steps drafting ``want`` with every third draft wrong."""
    sampling = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0,
                              max_new_tokens=N, stop_token_ids=())
    out = [ex.execute(StepPlan(prefills=[PrefillItem(0, prompt, sampling)]))[0]]
    while len(out) < N:
        if k:
            nxt = (want + [0] * k)[len(out):len(out) + k]
            drafts = [t + 1 if (len(out) + i) % 3 == 0 else t for i, t in enumerate(nxt)]
            out += ex.execute(StepPlan(decode_slots=[0], decode_tokens=[out[-1]], spec_k=k, drafts=[drafts]))[0]
        else:
            out.append(ex.execute(StepPlan(decode_slots=[0], decode_tokens=[out[-1]]))[0])
    return out[:N]


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    model = small_model()
    prompt = PreparedPrompt(input_ids=torch.randint(0, 290, (11,), generator=torch.Generator().manual_seed(2)))
    runner = ModelRunner(model, num_slots=2, max_context=96, device="cpu", options=RunnerOptions(gdn_kernel=True))
    spec_step.attach(runner, None, k=2, max_batch=2)
    ex = LocalExecutor(runner, Sampler(2, runner.vocab_size, "cpu"))
    want = greedy(ex, prompt)
    print(json.dumps(dict(plain=want, spec=greedy(ex, prompt, 2, want), impl=runner.impl["gdn_decode"])))


if __name__ == "__main__":
    main()
