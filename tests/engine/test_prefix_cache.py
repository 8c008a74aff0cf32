"""Kept prefix states (``prefix_cache.PrefixSnapshots``) on the small random Qwen3.5 (fp32, CPU): a slot started
from a kept prefix and prefilled only with the new tokens gives the reference's logits for the whole prompt,
the prefix's owner and other users of the same prefix are not disturbed, and every block comes back."""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.model.runner import Chunk, ModelRunner
from tests.support.small_model import TOL, Seq, image_seq, rel_err, small_model, text_ids


@pytest.fixture(scope="module")
def model():
    return small_model()


def step(runner, model, seqs: dict, gen) -> list[float]:
    """One batched decode step of every slot in ``seqs`` ({slot: Seq}) with random tokens; the errors."""
    slots = list(seqs)
    toks = torch.randint(0, 290, (len(slots),), generator=gen)
    for s, t in zip(slots, toks.tolist()):
        seqs[s].ids.append(t)
    out = runner.decode(slots, toks)
    return [rel_err(out[r], seqs[s].reference(model)) for r, s in enumerate(slots)]


@pytest.mark.parametrize("make_prefix", [lambda g: Seq(text_ids(g, 40)), image_seq], ids=["text", "image"])
def test_a_follow_up_prefills_only_its_new_tokens_and_matches_the_whole_prompt(model, make_prefix):
    gen = torch.Generator().manual_seed(21)
    first = make_prefix(gen)
    runner = ModelRunner(model, num_slots=3, max_context=160, num_blocks=24, device="cpu", block_tokens=16,
                         num_snapshots=2)
    runner.prefill(0, first.prompt())
    n = len(first.ids)
    runner.snapshots.take(0, 0)                       # kept at the end of the first prompt
    errs = []
    for _ in range(3):                                # the owner decodes on, into the shared partial block
        errs += step(runner, model, {0: first}, gen)
    followups = []
    for slot in (1, 2):                               # two follow-ups of the same prefix, different new text
        seq = Seq(first.ids[:n] + text_ids(gen, 9 + 7 * slot), first.image)
        assert runner.snapshots.restore(0, slot) == n
        logits = runner.prefill_batch([Chunk(slot, seq.prompt(), n)])
        errs.append(rel_err(logits[0], seq.reference(model)))
        followups.append((slot, seq))
    live = {0: first, **dict(followups)}
    for _ in range(4):
        errs += step(runner, model, live, gen)
    assert max(errs) <= TOL, errs
    if first.image is not None:
        assert runner.rope_deltas[1] == runner.rope_deltas[0] != 0


def test_kept_prefixes_give_every_block_back(model):
    """Blocks shared by a slot and an entry stay while either owns them and are free once both let go; an
    entry replaced or forgotten gives its blocks back."""
    gen = torch.Generator().manual_seed(22)
    runner = ModelRunner(model, num_slots=2, max_context=128, num_blocks=12, device="cpu", block_tokens=16,
                         num_snapshots=2)
    runner.prefill(0, Seq(text_ids(gen, 35)).prompt())       # 3 blocks
    runner.snapshots.take(0, 1)
    assert runner.tables.free_blocks == 9
    runner.free(0)
    assert runner.tables.free_blocks == 9                    # the entry still owns them
    runner.snapshots.restore(1, 1)                           # 2 shared + 1 copied
    assert runner.tables.free_blocks == 8
    runner.snapshots.take(1, 1)                              # replaced by the same prefix of slot 1
    runner.free(1)
    runner.snapshots.forget(1)
    assert runner.tables.free_blocks == 12
    with pytest.raises(KeyError):
        runner.snapshots.restore(1, 0)
    with pytest.raises(ValueError, match="out of range"):
        runner.snapshots.take(0, 5)
