"""The start-up warm-up (``startup.warmup``): on CPU it does nothing unless asked; asked, it runs every kind of
prefill (kept states, a restored follow-up, a later chunk, a burst, a photo) and leaves the runner as it found
it: every slot empty, every KV block free, and a prompt prefilled afterwards gets the logits it gets on a fresh
runner."""
from __future__ import annotations

import torch

from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.startup.warmup import warm_up_prefill
from qwen_chat.engine.types import PreparedPrompt


def test_warm_up_runs_every_kind_and_leaves_nothing_behind(tiny_loaded):
    runner = ModelRunner(tiny_loaded.model, num_slots=8, max_context=1024, num_blocks=160, device="cpu")
    free = runner.tables.free_blocks
    assert warm_up_prefill(runner, tiny_loaded, 256, 64) == 0.0          # CPU: nothing compiles on first use
    calls = []
    real = runner.prefill_batch

    def counting(chunks):
        calls.append([(c.slot, c.start, c.stop(), c.keeps, c.prompt.pixel_values is not None) for c in chunks])
        return real(chunks)

    runner.prefill_batch = counting
    assert warm_up_prefill(runner, tiny_loaded, 256, 64, device_types=("cpu",)) > 0
    assert calls[0] == [(0, 0, 1000, ((500, 1), (997, 2)), False)]     # two keep points in one chunk
    assert calls[1] == [(3, 997, 1017, (), False)]                      # a follow-up restored from the second
    assert calls[2] == [(0, 0, 256, (), False)] and calls[3] == [(0, 256, 384, (), False)]
    assert [c[0] for c in calls[4]] == list(range(8))                   # a burst of 8 prompts in one step,
    assert calls[4][-1][1:3] == (0, 30)                                 # the last one cut,
    assert calls[5] == [(7, 30, 32, (), False), (0, 0, 33, (), False)]  # continued beside a new one (35 tokens)
    assert calls[6][0][4]                                               # a photo
    assert all(runner.lengths[s] == 0 and runner.tables.count(s) == 0 for s in range(runner.num_slots))
    assert runner.tables.free_blocks == free
    prompt = PreparedPrompt(input_ids=torch.arange(40, dtype=torch.int64) + 100)
    fresh = ModelRunner(tiny_loaded.model, num_slots=8, max_context=1024, num_blocks=160, device="cpu")
    assert torch.allclose(runner.prefill(5, prompt), fresh.prefill(5, prompt), atol=1e-5)


def test_idle_captures_take_one_sequence_at_every_window_first():
    """While idle the engine captures batch 1 at every attention window before any larger batch (a lone user's
    8k or 100k prompt then finds its decode graph held), then every batch size up to IDLE_CONTEXT_LIMIT tokens;
    nothing already held is captured twice."""
    from types import SimpleNamespace

    from qwen_chat.engine.model import graphs
    from qwen_chat.engine.startup.runner_setup import IDLE_CONTEXT_LIMIT, READY_CONTEXTS, idle_captures

    buckets = graphs.context_buckets(262144)
    sizes = graphs.graph_batch_sizes(128)
    held = [(b, c) for c in READY_CONTEXTS for b in sizes]
    runner = SimpleNamespace(use_cuda_graphs=True, context_buckets=lambda: buckets,
                             graph_batch_sizes=lambda: sizes,
                             graphs=SimpleNamespace(decode_shapes=lambda: sorted(held)))
    order = idle_captures(runner)
    lone = [c for c in buckets if c not in READY_CONTEXTS]
    assert order[:len(lone)] == [(1, c) for c in lone]
    assert lone[-1] == 262144 and (1, 262144) in order
    rest = order[len(lone):]
    assert rest[0] == (2, min(c for c in buckets if c not in READY_CONTEXTS))
    assert all(c <= IDLE_CONTEXT_LIMIT and b > 1 for b, c in rest)
    assert not set(order) & set(held) and len(order) == len(set(order))
    runner.use_cuda_graphs = False
    assert idle_captures(runner) == []
