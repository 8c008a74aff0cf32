"""The decode step's compiled glue (``glue.compiled_once``, Inductor on the CPU here as on CUDA): one graph per
glue function that CUDA decodes with serves every batch size, the batch of one included, and every context
bucket, with the logits of the eager glue."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from qwen_chat.engine.model import glue
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PreparedPrompt
from tests.support.small_model import small_model, text_ids


@pytest.mark.slow  # Inductor compiles five glue functions for the CPU (about 15 s on 2 cores)
@torch.no_grad()
def test_compiled_glue_is_traced_once_for_every_batch_and_window():
    torch._dynamo.reset()
    model = small_model()
    gen = torch.Generator().manual_seed(8)
    prompts = [text_ids(gen, n) for n in (9, 30, 17, 520)]  # the last one decodes past the first window (512)
    runners = [ModelRunner(model, num_slots=4, max_context=1024, device="cpu",
                           options=RunnerOptions(compile_glue=compile)) for compile in (True, False)]
    assert runners[0].options.compile_glue and not runners[1].options.compile_glue
    # CUDA decodes the Gated DeltaNet token with its Triton kernel, not the glue's gdn_step (compiled as before)
    runners[0]._forward._glue["gdn_step"] = glue.GLUE["gdn_step"]
    for runner in runners:
        for slot, ids in enumerate(prompts):
            runner.prefill(slot, PreparedPrompt(input_ids=torch.tensor(ids)))
    graphs = []
    for step, slots in enumerate(([0], [0, 1], [0, 1, 2], [3], [0, 3], [2, 1, 3, 0], [1])):
        tokens = torch.randint(0, 250, (len(slots),), generator=gen)
        got, want = (r.decode(slots, tokens) for r in runners)
        assert torch.allclose(got, want, atol=1e-4), (step, (got - want).abs().max())
        graphs.append(counters["stats"]["unique_graphs"])
    windows = {runners[0].context_bucket(runners[0].lengths[s]) for s in range(4)}
    assert len(windows) == 2, windows  # batches of 1 to 4 rows over two context buckets ...
    assert graphs[0] >= 4 and graphs == [graphs[0]] * len(graphs), graphs  # ... all from the first step's graphs


@pytest.mark.slow  # one Inductor compile for the CPU (a few seconds)
def test_the_marks_stay_off_the_callers_tensors():
    """``compiled_once`` marks aliases of its arguments: a tensor the step passes on to another compiled function
    (or a kernel) arrives there unmarked (torch keeps the marks as attributes of the tensor object)."""
    run = glue.compiled_once(glue.attn_post, glue.ROW_ARGS["attn_post"])
    o, gate = torch.randn(3, 2, 2, 4), torch.randn(3, 16)
    assert torch.allclose(run(o, gate), glue.attn_post(o, gate))
    for t in (o, gate):
        assert not [name for name in vars(t) if name.startswith("_dynamo")], vars(t)


@pytest.mark.slow  # two Inductor compiles for the CPU (a few seconds)
def test_a_function_that_cannot_be_traced_once_is_compiled_per_shape_with_a_warning(caplog):
    """A function whose code asks for its row count (here: a branch on one row) cannot be traced with unbacked
    rows: ``compiled_once`` compiles it as TorchDynamo would on its own, logs why, and gives the right results."""
    def branchy(x):
        return x * 2 if x.shape[0] == 1 else x + 1

    run = glue.compiled_once(branchy, (0,))
    one, three = torch.randn(1, 4), torch.randn(3, 4)
    with caplog.at_level("WARNING", logger="qwen_chat.engine.model.glue"):
        assert torch.equal(run(one), one * 2)
    assert torch.equal(run(three), three + 1) and torch.equal(run(one), one * 2)
    assert "compiling once for every batch failed" in caplog.text and "branchy" in caplog.text
