"""Admission next to kept prefix states on the built-in tiny model (fp32, CPU, conversation cache on).

A kept prefix (a conversation turn's end, a long system block's end) takes a state row of its own.  With few
rows, the row that holds the prefix a waiting prompt matches may be the only one not running a sequence; the
prompt must then take that row over (it continues the kept state in place) instead of waiting for a running
reply to finish.  Measured in engine steps: the later prompt is prefilled within a few steps of its submission,
in a step that still decodes the first reply, and every reply equals its run on an engine without the cache.
"""
from __future__ import annotations

import threading

import pytest

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings
from qwen_chat.engine.core.chat_engine import ChatEngine
from qwen_chat.engine.core.kv_budget import BlockBudget
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from tests.support.spy_executor import SpyExecutor
from tests.support.waiting import wait_until

CONTEXT = 1024
FIRST_TOKENS = 300  # the first reply runs this long (greedy, the tiny model's random weights never stop early)
LATER_TOKENS = 12
#: Steps from a later prompt's submission to the step that prefills it: the step being built or in flight when
#: it came, then its own (one more in overlap mode, where a step is launched before the previous one's tokens
#: are back).  Waiting for the first reply would take hundreds.
MAX_STEPS_TO_ADMISSION = 3
LONG_SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(20))


def make(loaded, num_slots: int, cache: bool = True, overlap=False):
    runner = ModelRunner(loaded.model, num_slots=num_slots, max_context=CONTEXT, device="cpu")
    ex = SpyExecutor(runner, Sampler(num_slots, runner.vocab_size, "cpu"))
    engine = ChatEngine(loaded, runner, ex, image_token_budget=64, max_context=CONTEXT, max_queue=8,
                        num_slots=num_slots, conversation_cache=cache, overlap=overlap)
    return engine, ex


def greedy(n: int) -> GenerationSettings:
    return GenerationSettings.preset(False, temperature=0.0, max_new_tokens=n)


def last_update(engine, messages, n: int):
    last = None
    for last in engine.stream_chat(messages, greedy(n), CancelToken()):
        pass
    return last


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    """An engine without the conversation cache: the reply every prompt must get."""
    engine, _ = make(tiny_loaded, 2, cache=False)
    yield engine
    engine.close()


def user(text):
    return ChatMessage(role="user", text=text)


FIRST = [user("Tell me about the sea and the ships on it.")]
SYSTEM_FIRST = [ChatMessage(role="system", text=LONG_SYSTEM), user("Shared system, first user: rule 3?")]
SYSTEM_OTHER = [ChatMessage(role="system", text=LONG_SYSTEM), user("Shared system, another user: rule 7?")]

CASES = {
    # two rows: the first reply runs in one, its kept turn-end state fills the other
    "identical-prompt": (2, FIRST, [FIRST]),
    # two rows: a different prompt sharing a long system block, whose kept state fills the other row
    "shared-system-block": (2, SYSTEM_FIRST, [SYSTEM_OTHER]),
    # three rows: two identical prompts at once; one restores the kept state into the free row, the other then
    # takes over the kept row itself (not in the same step: that step copies from it)
    "burst-of-two": (3, FIRST, [FIRST, FIRST]),
}


@pytest.mark.parametrize("overlap", [False, None], ids=["waits", "overlap"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_prompt_matching_a_kept_prefix_never_waits_for_a_running_reply(tiny_loaded, reference, case, overlap):
    num_slots, first, later = CASES[case]
    engine, ex = make(tiny_loaded, num_slots, overlap=overlap)
    try:
        results = {}
        stream = engine.stream_chat(first, greedy(FIRST_TOKENS), CancelToken())
        t = threading.Thread(target=lambda: results.setdefault("first", list(stream)[-1]))
        t.start()
        wait_until(lambda: any(p.decode_slots for p in ex.plans), 60, "the first reply decoding")
        first_slot = ex.plans[0].prefills[0].slot
        submitted = len(ex.plans)
        streams = [engine.stream_chat(m, greedy(LATER_TOKENS), CancelToken()) for m in later]
        got = [list(s)[-1] for s in streams]
        t.join(300)
        assert not t.is_alive()

        admitted = [(i, item) for i, p in enumerate(ex.plans[submitted:], submitted) for item in p.prefills]
        assert len(admitted) == len(later), admitted  # each later prompt: one chunk, after its kept prefix
        for i, item in admitted:
            assert i - submitted <= MAX_STEPS_TO_ADMISSION, (
                f"a later prompt waited {i - submitted} steps (the first reply runs {FIRST_TOKENS})")
            assert first_slot in ex.plans[i].decode_slots, "admitted only after the first reply finished"
            assert item.start > 0  # it started from the kept state, not from a full prefill
        # no other row was free: one of them continued the kept state in the prefix's own row
        assert [item.restore == item.slot for _, item in admitted].count(True) == 1
        assert results["first"].completion_tokens == FIRST_TOKENS

        want = [last_update(reference, m, LATER_TOKENS) for m in later]
        for g, w, m in zip(got, want, later):
            assert (g.answer, g.completion_tokens) == (w.answer, w.completion_tokens)
            assert g.cached_tokens > 0 and w.cached_tokens == 0
        if case == "shared-system-block":
            assert got[0].cached_tokens == engine.prepare(SYSTEM_OTHER, greedy(1)).system_prefix

        # nothing leaks: once idle, the scheduler's count of blocks equals the runner's
        runner, batch = engine.runner, engine.scheduler._batch
        kept = set(batch.cache.rows())
        wait_until(lambda: all(runner.lengths[r] == 0 and runner.tables.count(r) == 0
                               for r in range(runner.num_slots) if r not in kept), 30, "the slots freed")
        stats = engine.scheduler.stats()
        assert stats["kv_blocks_used"] == 0
        assert stats["kv_blocks_cached"] == runner.num_blocks - runner.tables.free_blocks
        assert engine.scheduler.healthy
    finally:
        engine.close()


@pytest.mark.parametrize("owner", ["running", "finished"])
def test_the_block_count_of_a_kept_row_taken_over(owner):
    """The scheduler's count (``BlockBudget.start_from`` with the kept row as its own source): the row keeps
    the prefix's full blocks, gives back the partly filled one (freed when nothing else holds it) and takes
    its own for the rest; blocks that only kept prefixes held are no longer counted as evictable."""
    kv = BlockBudget(num_blocks=10, num_rows=2, max_blocks=10, block_tokens=4)
    kv.ensure(0, 10)                     # a sequence of 10 tokens: blocks of 4 + 4 + 2
    kv.keep(1, 0, 10)                    # its state at 10 kept in row 1: the same three blocks
    if owner == "finished":
        kv.release(0)
        assert (kv.free, kv.cached) == (7, 3)
    kv.start_from(1, 1, 10, 14)          # a prompt of 14 tokens continues the kept state in row 1
    assert kv.held(1) == 4 and kv.cached == 0
    assert kv.free == (5 if owner == "running" else 6)
    kv.release(0)
    assert (kv.free, kv.cached) == (6, 0)
    kv.release(1)
    assert (kv.free, kv.cached) == (10, 0)
