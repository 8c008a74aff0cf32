"""The piecewise, padded prefill of one short chunk (``prefill_graph.GraphPrefill``; CUDA graphs on a GPU, the
same pieces run eagerly here) on the small random Qwen3.5 (fp32, CPU): a chunk padded to its bucket gives the
reference's logits, and leaves the slot's KV, conv and recurrent state (and a keep point's) such that decoding
on, continuing in a later chunk, and restoring the kept prefix all equal transformers on the whole sequence."""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.model.options import RunnerOptions, resolve_options
from qwen_chat.engine.model.prefill_graph import GraphPrefill
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PrefillItem
from tests.support.small_model import TOL, Seq, decode_steps, image_seq, rel_err, small_model, text_ids


@pytest.fixture(scope="module")
def model():
    return small_model()


def padded_runner(model, buckets=(8, 16, 32, 96), **kw) -> tuple[ModelRunner, list]:
    """A runner whose single-chunk prefills go through ``GraphPrefill`` with small buckets; the list records
    every chunk it ran (slot, n)."""
    kw = dict(num_slots=5, max_context=200, num_blocks=60, block_tokens=16) | kw
    runner = ModelRunner(model, device="cpu", options=RunnerOptions(prefill_graphs=True), **kw)
    gp = GraphPrefill(runner._forward, scratch_slot=runner.num_slots, max_context=runner.max_context,
                      buckets=buckets)
    ran = []
    run = gp.run
    gp.run = lambda emb, cos, sin, sq: ran.append((sq.slot, sq.n)) or run(emb, cos, sin, sq)
    runner.graph_prefill = gp
    return runner, ran


@pytest.mark.parametrize("n", [1, 8, 9, 33, 70], ids=lambda n: f"{n}-tokens")
def test_a_padded_prompt_equals_the_reference_and_decodes_on(model, n):
    """Lengths at and just past a bucket's edge, and one padded across the delta rule's 64-token chunks (70 in
    96): the logits, then three decode steps from the state the padded prefill left."""
    gen = torch.Generator().manual_seed(n)
    seq = Seq(text_ids(gen, n))
    runner, ran = padded_runner(model)
    errs = [rel_err(runner.prefill(2, seq.prompt()), seq.reference(model))]
    errs += decode_steps(runner, model, {2: seq}, gen, 3)
    assert ran == [(2, n)]
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("make_first", [lambda g: Seq(text_ids(g, 40)), image_seq], ids=["text", "image"])
def test_a_keep_point_a_later_chunk_and_a_restored_follow_up(model, make_first):
    """A prompt in two chunks (the second continues the slot's cache and states; a boundary inside the image),
    keeping its state 3 tokens before its end; a follow-up restores the kept prefix and prefills only its new
    tokens: every logits row and the decode steps after equal the reference."""
    gen = torch.Generator().manual_seed(5)
    first = make_first(gen)
    L = len(first.ids)
    p, cut = L - 3, L - 12
    runner, ran = padded_runner(model)
    assert runner.prefill_batch([PrefillItem(0, first.prompt(), start=0, end=cut, resume=True)]) is None
    logits = runner.prefill_batch([PrefillItem(0, first.prompt(), start=cut, keeps=((p, 4),))])
    errs = [rel_err(logits[0], first.reference(model))]
    assert runner.lengths[4] == p
    errs += decode_steps(runner, model, {0: first}, gen, 2)
    follow = Seq(first.ids[:p] + text_ids(gen, 11), first.image)
    assert runner.restore(4, 1) == p
    logits = runner.prefill_batch([PrefillItem(1, follow.prompt(), start=p)])
    errs.append(rel_err(logits[0], follow.reference(model)))
    errs += decode_steps(runner, model, {0: first, 1: follow}, gen, 3)
    assert [slot for slot, _ in ran] == [0, 0, 1], ran
    assert max(errs) <= TOL, errs


def test_what_the_pieces_do_not_take_runs_packed(model):
    """Two chunks in one step, a chunk longer than the last bucket and a chunk with two keep points run the
    packed prefill, and give the reference's logits too."""
    gen = torch.Generator().manual_seed(9)
    a, b, long, two = Seq(text_ids(gen, 10)), Seq(text_ids(gen, 12)), Seq(text_ids(gen, 40)), Seq(text_ids(gen, 30))
    runner, ran = padded_runner(model, buckets=(8, 32), num_slots=6)
    logits = runner.prefill_batch([PrefillItem(0, a.prompt()), PrefillItem(1, b.prompt())])
    errs = [rel_err(logits[0], a.reference(model)), rel_err(logits[1], b.reference(model))]
    errs.append(rel_err(runner.prefill(2, long.prompt()), long.reference(model)))
    logits = runner.prefill_batch([PrefillItem(3, two.prompt(), keeps=((10, 4), (20, 5)))])
    errs.append(rel_err(logits[0], two.reference(model)))
    assert ran == []
    assert max(errs) <= TOL, errs


def test_the_padding_leaves_the_same_state_as_the_packed_prefill(model):
    """The slot's KV rows, conv ring and recurrent state after a padded prefill (10 tokens in 32) equal those
    after the packed prefill of the same prompt, and so does a keep row's state."""
    gen = torch.Generator().manual_seed(3)
    seq = Seq(text_ids(gen, 10))
    padded, _ = padded_runner(model, buckets=(32,))
    packed = ModelRunner(model, device="cpu", num_slots=5, max_context=200, num_blocks=60, block_tokens=16,
                         options=RunnerOptions(prefill_graphs=False))
    for r in (padded, packed):
        r.prefill_batch([PrefillItem(1, seq.prompt(), keeps=((6, 3),))])
    for slot in (1, 3):
        rows_a = padded.tables.positions(slot, 0, padded.lengths[slot])
        rows_b = packed.tables.positions(slot, 0, packed.lengths[slot])
        for i in range(len(padded.k_cache)):
            if padded._forward._kinds[i] == "linear":
                torch.testing.assert_close(padded.conv_state[i][slot], packed.conv_state[i][slot])
                torch.testing.assert_close(padded.rec_state[i][slot], packed.rec_state[i][slot], rtol=1e-4, atol=1e-5)
            else:
                kc_a = padded.k_cache[i].view(-1, *padded.k_cache[i].shape[-2:])
                kc_b = packed.k_cache[i].view(-1, *packed.k_cache[i].shape[-2:])
                torch.testing.assert_close(kc_a[rows_a], kc_b[rows_b], rtol=1e-4, atol=1e-5)


def test_prefill_graphs_are_refused_where_their_pieces_cannot_run():
    """Auto: off without CUDA graphs and under tensor parallelism (its all-reduces are not captured); asked for
    under ZeRO-3 or tensor parallelism: a ValueError that says why."""
    cpu = torch.device("cpu")
    assert resolve_options(RunnerOptions(), device=cpu, zero3=False, gdn_fits=False).prefill_graphs is False
    assert resolve_options(RunnerOptions(prefill_graphs=True), device=cpu, zero3=False, gdn_fits=False).prefill_graphs
    for where in (dict(zero3=True), dict(zero3=False, tensor_parallel=True)):
        with pytest.raises(ValueError, match="prefill graphs cannot be used under ZeRO-3 or tensor parallelism"):
            resolve_options(RunnerOptions(prefill_graphs=True), device=cpu, gdn_fits=False, **where)
