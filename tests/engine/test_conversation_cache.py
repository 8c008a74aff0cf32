"""The conversation cache end to end on the built-in tiny model (fp32, CPU): every turn of a conversation gives
the same greedy reply with the cache as without it (text, images reused two turns later, thinking on and off,
a stopped reply, Regenerate, an edited earlier message, a changed system prompt, a long system prompt shared by
other conversations), follow-ups report the prompt tokens they did not prefill, and under a small budget the kept states give way to running sequences without a
block leak."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings
from qwen_chat.engine.model.options import RunnerOptions
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.core.chat_engine import ChatEngine
from tests.support.waiting import wait_until

IMAGES = Path(__file__).parents[1] / "fixtures" / "images"
CONTEXT = 1024


def make(loaded, cache: bool, num_slots: int = 4, num_blocks=None, options=RunnerOptions()) -> ChatEngine:
    runner = ModelRunner(loaded.model, num_slots=num_slots, max_context=CONTEXT, num_blocks=num_blocks, device="cpu",
                         options=options)
    executor = LocalExecutor(runner, Sampler(num_slots, runner.vocab_size, "cpu"))
    return ChatEngine(loaded, runner, executor, image_token_budget=64, max_context=CONTEXT, max_queue=16,
                      num_slots=num_slots, conversation_cache=cache)


@pytest.fixture(scope="module")
def engines(tiny_loaded):
    on, off = make(tiny_loaded, True), make(tiny_loaded, False)
    yield on, off
    on.close()
    off.close()


def settings(thinking=False, n=20):
    return GenerationSettings.preset(thinking, temperature=0.0, max_new_tokens=n)


def reply(engine, messages, thinking=False, n=20, stop_after=None):
    """(reasoning, answer, completion tokens, cached tokens) of one greedy turn; ``stop_after``: press Stop once
    that many updates came."""
    cancel = CancelToken()
    last = None
    for i, u in enumerate(engine.stream_chat(messages, settings(thinking, n), cancel)):
        last = u
        if stop_after is not None and i + 1 == stop_after:
            cancel.cancel()
    return last.reasoning, last.answer, last.completion_tokens, last.cached_tokens


def both(engines, messages, thinking=False, n=20, stop_after=None):
    on, off = engines
    got = reply(on, messages, thinking, n, stop_after)
    want = reply(off, messages, thinking, n, stop_after)
    assert got[:3] == want[:3]
    assert want[3] == 0
    return got


def u(text, *images):
    return ChatMessage(role="user", text=text, images=tuple(str(IMAGES / i) for i in images))


def a(turn):
    return ChatMessage(role="assistant", text=turn[1], reasoning=turn[0])


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_each_turn_equals_a_full_prefill_and_reports_what_it_reused(engines, thinking):
    system = ChatMessage(role="system", text=f"You are terse ({thinking}).")
    msgs = [system, u("Describe this picture.", "chelsea.png")]
    t1 = both(engines, msgs, thinking)
    assert t1[3] == 0                                     # a new conversation: nothing kept yet
    msgs += [a(t1), u("And the colours?")]
    t2 = both(engines, msgs, thinking)
    prompt1 = engines[0].prepare(msgs[:2], settings(thinking))
    assert t2[3] == prompt1.shared_prefix > 0             # the image is in the reused part
    msgs += [a(t2), u("Compare it with the first answer.")]
    t3 = both(engines, msgs, thinking)
    assert t3[3] == engines[0].prepare(msgs[:4], settings(thinking)).shared_prefix
    regen = both(engines, msgs, thinking)                 # Regenerate: the same prompt once more
    assert regen[:3] == t3[:3]
    assert regen[3] == engines[0].prepare(msgs, settings(thinking)).shared_prefix


def test_stopped_replies_edits_and_a_new_system_prompt(engines):
    msgs = [u("Count to twenty.")]
    t1 = reply(engines[0], msgs, n=40, stop_after=3)       # stopped after 3 updates (where exactly is timing)
    assert t1[2] < 40
    msgs += [a(t1), u("Go on.")]                           # the partial reply is the history of both
    t2 = both(engines, msgs)
    assert t2[3] > 0
    edited = [u("Count to ten.")] + msgs[1:]               # an earlier message edited: no false hit
    assert both(engines, edited)[3] == 0
    other = [ChatMessage(role="system", text="Be formal.")] + msgs
    assert both(engines, other)[3] == 0                    # a changed system prompt: nothing shared


def test_two_users_with_the_same_system_prompt_at_once_equal_their_solo_runs(engines, tiny_loaded):
    import threading

    system = ChatMessage(role="system", text="Shared rules for everyone.")
    convs = [[system, u(f"User {i} asks about topic {i}.")] for i in range(3)]
    solo = [reply(engines[1], c) for c in convs]
    results = {}

    def chat(i):
        results[i] = reply(engines[0], convs[i])

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i][:3] for i in range(3)] == [s[:3] for s in solo]


LONG_SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(20))


def test_a_long_system_prompt_is_shared_by_other_conversations(engines, tiny_loaded):
    """A system prompt of at least ``SYSTEM_KEEP_MIN_TOKENS``: three users starting at once each get their solo
    reply; the conversations after them start from the kept system block (``cached_tokens`` = its length,
    counted in the metrics) and still equal their solo runs; a system prompt one token different gets no hit."""
    from qwen_chat.engine.core.conv_cache import SYSTEM_KEEP_MIN_TOKENS

    on = make(tiny_loaded, True, num_slots=8)
    try:
        system = ChatMessage(role="system", text=LONG_SYSTEM)
        convs = [[system, u(f"Shared system, user {i}: what is rule {i}?")] for i in range(5)]
        block = on.prepare(convs[0], settings()).system_prefix
        assert block >= SYSTEM_KEEP_MIN_TOKENS
        solo = [reply(engines[1], c)[:3] for c in convs]
        with on.scheduler._batch.cond:  # the first three are planned in one step
            streams = [on.stream_chat(c, settings(), CancelToken()) for c in convs[:3]]
        got = []
        for updates in streams:
            last = None
            for last in updates:
                pass
            got.append(((last.reasoning, last.answer, last.completion_tokens), last.cached_tokens))
        assert [g[0] for g in got] == solo[:3] and [g[1] for g in got] == [0, 0, 0]
        for i in (3, 4):
            r = reply(on, convs[i])
            assert r[:3] == solo[i] and r[3] == block
        assert on.stats()["prefix_cache_system_hits_total"] == 2
        changed = [ChatMessage(role="system", text=LONG_SYSTEM.replace("Rule 19", "Rule 91")), convs[0][1]]
        assert reply(on, changed)[3] == 0
        follow = convs[3] + [a(solo[3]), u("And rule 7?")]   # the conversation's own keep point is longer
        r = reply(on, follow)
        assert r[:3] == reply(engines[1], follow)[:3] and r[3] == on.prepare(convs[3], settings()).shared_prefix
    finally:
        on.close()


def test_an_evicted_system_block_falls_back_to_a_full_prefill(tiny_loaded, engines):
    """Under a budget of few rows and blocks the kept system block gives way to running sequences; the next
    conversation with that system prompt is prefilled in full and gets its solo reply."""
    engine = make(tiny_loaded, True, num_slots=3, num_blocks=16)
    try:
        system = ChatMessage(role="system", text=LONG_SYSTEM)
        first = [system, u("First user.")]
        reply(engine, first)
        assert engine.stats()["prefix_cache_entries"] >= 1
        others = [[u(f"Unrelated conversation {i} with a longer question to fill the cache blocks " * 6)]
                  for i in range(4)]
        for c in others:
            reply(engine, c)
        late = [system, u("Late user.")]
        r = reply(engine, late)
        assert r[3] == 0 and r[:3] == reply(engines[1], late)[:3]
    finally:
        engine.close()


def assert_cached_count(batch) -> None:
    """The scheduler's running count of blocks only kept states hold equals a count from its block tables."""
    with batch.cond:
        tables, rows = batch.kv._tables, batch.cache.rows()
        held = {}
        for r in rows:
            for blk in tables.blocks(r):
                held[blk] = held.get(blk, 0) + 1
        assert batch.kv.cached == sum(1 for blk, n in held.items() if n == tables.owners(blk))


def test_eviction_under_a_small_budget_leaks_no_block(tiny_loaded):
    """500 random turns of 6 conversations (follow-ups, regenerates, edits) on 3 slots and few blocks: every
    reply finishes, kept states are evicted for running sequences, and afterwards every block not held by a
    kept state is free."""
    engine = make(tiny_loaded, True, num_slots=3, num_blocks=24)
    rng = random.Random(7)
    system = ChatMessage(role="system", text=LONG_SYSTEM)   # half of them share a long system prompt
    convs = [([system] if i % 2 else []) + [u(f"Conversation {i}: hello.")] for i in range(6)]
    finished = 0
    try:
        for turn in range(500):
            c = rng.randrange(6)
            msgs = convs[c]
            action = rng.random()
            if action < 0.15 and len(msgs) > 2:
                msgs = msgs[:-2]                          # regenerate the previous turn
            elif action < 0.25:
                head = [system] if c % 2 else []
                msgs = head + [u(f"Conversation {c} edited {turn}.")] + msgs[len(head) + 1:]
            out = reply(engine, msgs, n=rng.choice([1, 2, 3]))
            finished += 1
            if turn % 25 == 0:
                assert_cached_count(engine.scheduler._batch)
            head = [system] if c % 2 else []
            convs[c] = msgs + [a(out), u(f"turn {turn}")] if len(msgs) < 7 else head + [u(f"restart {turn}")]
        batch = engine.scheduler._batch
        stats = engine.scheduler.stats()
        assert finished == 500 and stats["active"] == 0
        assert stats["cache"]["hits"] > 50                    # follow-ups hit even as states are evicted
        assert stats["cache"]["system_hits"] > 5              # new conversations start from the system block
        runner = engine.runner
        kept = set(batch.cache.rows())
        # the last reply's slot is freed in the runner by the scheduler's next (idle) step
        wait_until(lambda: all(runner.lengths[r] == 0 and runner.tables.count(r) == 0
                               for r in range(runner.num_slots) if r not in kept), timeout_s=30)
        stats = engine.scheduler.stats()                     # the scheduler's count equals the runner's
        assert stats["kv_blocks_used"] == 0
        assert stats["kv_blocks_cached"] == runner.num_blocks - runner.tables.free_blocks > 0
        held = {blk for r in kept for blk in runner.tables.blocks(r)}  # every block in use is a kept prefix's
        assert runner.num_blocks - runner.tables.free_blocks == len(held)
        assert all(tuple(runner.tables.blocks(r)) == batch.kv.table(r) for r in range(runner.num_slots))
    finally:
        engine.close()


def test_the_same_new_prompt_from_several_users_in_one_step_is_answered_for_each(engines, tiny_loaded):
    """Identical first prompts planned in one step (two users asking the same question, a client retrying): a
    prompt admitted in the step whose prefill keeps that prefix must not start from it before it is written.
    The four requests are queued while the scheduler is held, so they are planned together (with rows to spare
    for keeping prefixes); each gets its solo reply and the engine keeps serving."""
    on = make(tiny_loaded, True, num_slots=12)
    try:
        convs = [[u(f"Same step: question number {i}.")] for i in (0, 1, 1, 0)]
        solo = [reply(engines[1], c)[:3] for c in convs]
        with on.scheduler._batch.cond:  # re-entrant: each stream_chat queues its request inside
            streams = [on.stream_chat(c, settings(), CancelToken()) for c in convs]
        got = []
        for updates in streams:
            last = None
            for last in updates:
                pass
            got.append((last.reasoning, last.answer, last.completion_tokens))
        assert got == solo
        assert on.scheduler.healthy
        assert reply(on, convs[0])[:3] == solo[0]
    finally:
        on.close()


def test_turns_through_the_padded_prefill_pieces_equal_the_packed_prefill(engines, tiny_loaded):
    """The prefill graphs' padded pieces (CUDA graphs on a GPU, run eagerly here) inside the engine: a conversation
    with a photo and a long system prompt, follow-ups restored from the cache, a Regenerate and a new conversation
    starting from the shared system block give the greedy replies of the engine without the cache, turn by turn."""
    padded = make(tiny_loaded, True, num_slots=8, options=RunnerOptions(prefill_graphs=True))
    ran = []
    gp = padded.runner.graph_prefill
    run = gp.run
    gp.run = lambda emb, cos, sin, sq: ran.append((sq.start, sq.n)) or run(emb, cos, sin, sq)
    pair = (padded, engines[1])
    try:
        system = ChatMessage(role="system", text=LONG_SYSTEM)
        msgs = [system, u("Describe this picture.", "chelsea.png")]
        t1 = both(pair, msgs, thinking=True)
        msgs += [a(t1), u("And the colours?")]
        t2 = both(pair, msgs, thinking=True)
        assert t2[3] > 0
        msgs += [a(t2), u("Compare it with the first answer.")]
        t3 = both(pair, msgs, thinking=True)
        assert both(pair, msgs, thinking=True)[:3] == t3[:3]     # Regenerate
        assert both(pair, [system, u("Something else.")])[3] > 0  # from the kept system block
        assert sum(start > 0 for start, _ in ran) >= 3, ran      # the follow-ups ran through the pieces
    finally:
        padded.close()
