"""Kept prefix states (``prefix_cache``, ``PrefillItem.keeps``, ``ModelRunner.restore``) on the small random
Qwen3.5 (fp32, CPU): the state kept at an inner position of a prompt, restored into another slot and prefilled
only with the new tokens, gives the reference's logits for the whole new prompt; the prompt that kept it, and
other users of the same prefix, are not disturbed; images inside the prefix are not encoded again; every block
comes back."""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PrefillItem
from tests.support.small_model import TOL, Seq, decode_steps, image_seq, rel_err, small_model, text_ids


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.mark.parametrize("make_first", [lambda g: Seq(text_ids(g, 40)), image_seq], ids=["text", "image"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunked"])
def test_a_follow_up_prefills_only_its_new_tokens_and_matches_the_whole_prompt(model, make_first, chunked):
    """The first prompt keeps its state 3 tokens before its end (where a chat prompt's generation suffix
    starts), next to another prompt in the same packed prefill; two follow-ups sharing those tokens start from
    it and equal the reference, while the first prompt decodes on."""
    gen = torch.Generator().manual_seed(21)
    first = make_first(gen)
    other = Seq(text_ids(gen, 23))
    L = len(first.ids)
    p = L - 3
    runner = ModelRunner(model, num_slots=6, max_context=160, num_blocks=40, device="cpu", block_tokens=16)
    errs = []
    if chunked:  # the keep point lies in the first of two chunks, a boundary inside the image
        logits = runner.prefill_batch([PrefillItem(0, first.prompt(), start=0, end=p - 5), PrefillItem(3, other.prompt())])
        errs.append(rel_err(logits[0], other.reference(model)))
        logits = runner.prefill_batch([PrefillItem(0, first.prompt(), start=p - 5, keeps=((p, 5),))])
        errs.append(rel_err(logits[0], first.reference(model)))
    else:
        logits = runner.prefill_batch([PrefillItem(3, other.prompt()), PrefillItem(0, first.prompt(), keeps=((p, 5),))])
        errs += [rel_err(logits[0], other.reference(model)), rel_err(logits[1], first.reference(model))]
    assert runner.lengths[5] == p and runner.tables.count(5) == -(-p // 16)
    errs += decode_steps(runner, model, {0: first, 3: other}, gen, 1)   # the owner writes on into the shared block
    followups = {}
    for slot in (1, 2):
        seq = Seq(first.ids[:p] + text_ids(gen, 9 + 7 * slot), first.image)
        assert runner.restore(5, slot) == p
        logits = runner.prefill_batch([PrefillItem(slot, seq.prompt(), start=p)])
        errs.append(rel_err(logits[0], seq.reference(model)))
        followups[slot] = seq
    for _ in range(3):
        errs += decode_steps(runner, model, {0: first, 3: other, **followups}, gen, 1)
    assert max(errs) <= TOL, errs
    if first.image is not None:
        assert runner.rope_deltas[1] == runner.rope_deltas[0] != 0


def test_a_kept_prefix_at_the_end_of_a_chunk_and_a_regenerated_reply(model):
    """Kept at the chunk's last position (no split) and restored for the same prompt once more (a
    Regenerate): the new first token's logits equal the first run's."""
    gen = torch.Generator().manual_seed(23)
    seq = Seq(text_ids(gen, 30))
    runner = ModelRunner(model, num_slots=3, max_context=96, num_blocks=12, device="cpu", block_tokens=16)
    first = runner.prefill_batch([PrefillItem(0, seq.prompt(), start=0, end=26, resume=True, keeps=((26, 2),))])
    assert first is None
    logits = runner.prefill_batch([PrefillItem(0, seq.prompt(), start=26)])
    runner.free(0)
    runner.restore(2, 1)
    again = runner.prefill_batch([PrefillItem(1, seq.prompt(), start=26)])
    assert rel_err(again[0], logits[0]) <= TOL
    assert rel_err(again[0], seq.reference(model)) <= TOL


def test_images_inside_the_kept_prefix_are_not_encoded_again(model, monkeypatch):
    gen = torch.Generator().manual_seed(24)
    first = image_seq(gen)
    runner = ModelRunner(model, num_slots=3, max_context=128, num_blocks=20, device="cpu", block_tokens=16)
    p = len(first.ids) - 2
    runner.prefill_batch([PrefillItem(0, first.prompt(), keeps=((p, 2),))])
    seq = Seq(first.ids[:p] + text_ids(gen, 6), first.image)
    ref = seq.reference(model)
    encoded = []
    real = model.model.get_image_features
    monkeypatch.setattr(model.model, "get_image_features",
                        lambda *a, **kw: encoded.append(a[1]) or real(*a, **kw))
    runner.restore(2, 1)
    logits = runner.prefill_batch([PrefillItem(1, seq.prompt(), start=p)])
    monkeypatch.undo()
    assert encoded == []
    assert rel_err(logits[0], ref) <= TOL


def test_kept_prefixes_give_every_block_back(model):
    """Blocks shared by a slot and a kept row stay while either owns them and are free once both let go."""
    gen = torch.Generator().manual_seed(22)
    runner = ModelRunner(model, num_slots=3, max_context=128, num_blocks=12, device="cpu", block_tokens=16)
    runner.prefill_batch([PrefillItem(0, Seq(text_ids(gen, 35)).prompt(), keeps=((33, 2),))])   # 3 blocks, 3 shared
    assert runner.tables.free_blocks == 9
    runner.free(0)
    assert runner.tables.free_blocks == 9                    # the kept row still owns them
    runner.restore(2, 1)                                     # 2 shared + 1 copied
    assert runner.tables.free_blocks == 8
    runner.free(1)
    runner.free(2)
    assert runner.tables.free_blocks == 12
    with pytest.raises(ValueError, match="holds tokens"):
        runner.restore(2, 0)
    with pytest.raises(ValueError, match="outside the chunk"):
        runner.prefill_batch([PrefillItem(0, Seq(text_ids(gen, 10)).prompt(), keeps=((11, 2),))])
    runner.prefill_batch([PrefillItem(0, Seq(text_ids(gen, 10)).prompt(), keeps=((5, 2),))])
    with pytest.raises(ValueError, match="in use"):
        runner.prefill_batch([PrefillItem(1, Seq(text_ids(gen, 10)).prompt(), keeps=((5, 2),))])


def test_two_keep_points_in_one_chunk_both_serve_their_follow_ups(model):
    """A system block's end and a turn's end kept in the same chunk (next to another prompt): the prompt's own
    logits and follow-ups restored from either kept state equal the reference."""
    gen = torch.Generator().manual_seed(31)
    first, other = Seq(text_ids(gen, 45)), Seq(text_ids(gen, 12))
    runner = ModelRunner(model, num_slots=6, max_context=160, num_blocks=40, device="cpu", block_tokens=16)
    logits = runner.prefill_batch([PrefillItem(3, other.prompt()),
                                   PrefillItem(0, first.prompt(), keeps=((20, 4), (42, 5)))])
    errs = [rel_err(logits[0], other.reference(model)), rel_err(logits[1], first.reference(model))]
    assert (runner.lengths[4], runner.lengths[5]) == (20, 42)
    for row, p, slot in ((4, 20, 1), (5, 42, 2)):
        seq = Seq(first.ids[:p] + text_ids(gen, 8))
        assert runner.restore(row, slot) == p
        errs.append(rel_err(runner.prefill_batch([PrefillItem(slot, seq.prompt(), start=p)])[0], seq.reference(model)))
    assert max(errs) <= TOL, errs
    with pytest.raises(ValueError, match="increasing"):
        runner.prefill_batch([PrefillItem(1, first.prompt(), keeps=((30, 2), (10, 3)))])


@pytest.mark.parametrize("owner", ["running", "finished"])
def test_a_kept_row_taken_over_in_place_continues_its_state(model, owner):
    """``restore(row, row)`` (the scheduler's take-over when no other row is free): the prompt continued in the
    kept prefix's own row equals the reference while the prompt that kept it decodes on (or after it finished
    and freed its slot); the row shares the prefix's full blocks, writes into a copy of the partly filled one,
    and every block comes back."""
    gen = torch.Generator().manual_seed(25)
    first = Seq(text_ids(gen, 37))
    p = 34  # two full blocks of 16 and a partly filled third
    runner = ModelRunner(model, num_slots=2, max_context=96, num_blocks=12, device="cpu", block_tokens=16)
    logits = runner.prefill_batch([PrefillItem(0, first.prompt(), keeps=((p, 1),))])
    errs = [rel_err(logits[0], first.reference(model))]
    kept = runner.tables.blocks(1)
    seqs = {}
    if owner == "running":
        errs += decode_steps(runner, model, {0: first}, gen, 1)  # the owner writes into the partly filled block they share
        seqs[0] = first
    else:
        runner.free(0)
    seq = Seq(first.ids[:p] + text_ids(gen, 9))
    assert runner.restore(1, 1) == p
    blocks = runner.tables.blocks(1)
    assert blocks[:2] == kept[:2] and blocks[2] != kept[2]
    logits = runner.prefill_batch([PrefillItem(1, seq.prompt(), start=p)])
    errs.append(rel_err(logits[0], seq.reference(model)))
    for _ in range(3):
        errs += decode_steps(runner, model, {**seqs, 1: seq}, gen, 1)
    assert max(errs) <= TOL, errs
    runner.free(0)
    runner.free(1)
    assert runner.tables.free_blocks == 12
