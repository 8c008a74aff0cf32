"""GPU-only checks of speculative decoding: the verify step through its CUDA graphs leaves the exact state of
plain decoding after any partial acceptance, the MTP head's drafting through its CUDA graphs gives its eager
drafts, and greedy replies with oracle (partly wrong) and MTP-head drafts equal plain decoding, on the tiny
checkpoint in fp32.  Skipped without CUDA.  Run on a GPU host:
``python -m pytest -q tests/gpu/test_speculative_cuda.py``.
"""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.model import spec_step
from qwen_chat.engine.model.mtp import load_mtp_head
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.model.speculative import device_ints
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.types import PrefillItem, PreparedPrompt, SamplingParams, StepPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0, max_new_tokens=64,
                        stop_token_ids=())


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    from qwen_chat.engine.checkpoints.loading import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return load_model(tiny_checkpoint, "cuda", torch.float32)


def runner_for(loaded, k):
    runner = ModelRunner(loaded.model, num_slots=4, max_context=1024, device="cuda")
    assert runner.use_cuda_graphs
    if k:
        head = load_mtp_head(loaded.checkpoint, loaded.model.config.text_config, device="cuda", dtype=torch.float32)
        spec_step.attach(runner, head, k=k, max_batch=4)
    return runner


def prompt(seed=3, length=37):
    return PreparedPrompt(input_ids=torch.randint(0, 5000, (length,), generator=torch.Generator().manual_seed(seed)))


def test_graph_verify_leaves_the_state_of_plain_decoding(loaded):
    for a in range(3):
        runner = runner_for(loaded, 2)
        runner.prefill(0, prompt())
        runner.copy_slot(0, 1)
        fed = [7, 11, 13][:a + 1]
        for t in fed:
            runner.decode([0], torch.tensor([t]))
        runner.spec.verifier.verify([1], torch.tensor([fed + [19, 23][:2 - a]], device="cuda"))
        runner.spec.verifier.accept([1], [a + 1])
        assert runner.spec.verifier.graphs_for(3).count() > 0
        for i in runner.rec_state:
            assert torch.allclose(runner.rec_state[i][1], runner.rec_state[i][0], atol=1e-4), (a, i)
            assert torch.allclose(runner.conv_state[i][1], runner.conv_state[i][0], atol=1e-5), (a, i)
        nxt = runner.decode([0, 1], torch.tensor([31, 31]))
        assert torch.allclose(nxt[1], nxt[0], atol=1e-3), a


@torch.no_grad()
def test_graph_drafting_gives_the_eager_drafts(loaded):
    """Three slots (padded to 4 in the graph), k = 3: after their prompts and after each of three speculative
    steps (the head drafting through its graphs), the graph's drafts equal ``MtpDrafter.draft`` run eagerly on
    the same inputs."""
    runner = runner_for(loaded, 3)
    drafter = runner.spec.drafter
    assert drafter.graphs is not None
    ex = LocalExecutor(runner, Sampler(4, runner.vocab_size, "cuda"))
    last = ex.execute(StepPlan(prefills=[PrefillItem(s, prompt(s, 30 + 7 * s), GREEDY) for s in range(3)]))
    for step in range(4):
        rows = [(s, *drafter._pending[s], drafter._start[s], runner.rope_deltas[s]) for s in range(3)]
        ctx = runner.context_bucket(max(r[1] for r in rows) + 4 + 3)
        runner.spec.verifier.prepare([0, 1, 2], 4)
        eager = drafter.draft(device_ints([list(c) for c in zip(*rows)], "cuda"), ctx, 3)
        assert torch.equal(drafter.graphs.run(rows, ctx, 3), eager), step
        if step < 3:
            out = ex.execute(StepPlan(decode_slots=[0, 1, 2], decode_tokens=list(last), spec_k=3))
            last = [run[-1] for run in out]
    assert drafter.graphs.count() >= 1


def _greedy(ex, p, k=0, drafts_of=None):
    out = [ex.execute(StepPlan(prefills=[PrefillItem(0, p, GREEDY)]))[0]]
    while len(out) < 64:
        if k:
            drafts = [drafts_of(out)] if drafts_of is not None else []
            out += ex.execute(StepPlan(decode_slots=[0], decode_tokens=[out[-1]], spec_k=k, drafts=drafts))[0]
        else:
            out.append(ex.execute(StepPlan(decode_slots=[0], decode_tokens=[out[-1]]))[0])
    return out[:64]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_replies_equal_plain_decoding_on_cuda(loaded, k):
    plain = runner_for(loaded, 0)
    want = _greedy(LocalExecutor(plain, Sampler(4, plain.vocab_size, "cuda")), prompt())
    runner = runner_for(loaded, k)
    ex = LocalExecutor(runner, Sampler(4, runner.vocab_size, "cuda"))
    assert _greedy(ex, prompt(), k) == want
    gen = torch.Generator().manual_seed(k)
    right = lambda t: t if float(torch.rand(1, generator=gen)) < 0.7 else t + 1  # noqa: E731
    assert _greedy(ex, prompt(), k, lambda out: [right(t) for t in (want + [0] * 4)[len(out):len(out) + k]]) == want
