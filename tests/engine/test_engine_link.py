"""The engine link on the tiny model: a real ``ChatEngine`` served by ``core.link.serve_engine`` (in a thread)
to an ``EngineHub`` / ``EngineClient`` (the front's end), over real ZeroMQ sockets, as the service runs them
between its engine process and its web front.

Checks what a user of the front sees: replies equal the engine's own in-process replies (greedy, with an image,
n = 2 with log-probabilities), 64 concurrent API streams (asyncio) and 4 page users (threads, as the UI's
handlers run) each equal their solo run with no cross-talk, refusals
raised before any update, Stop and a closed stream freeing the slot, a slow reader getting merged deltas whose
concatenation is the fast reader's text, ``stream_interval`` 4 giving the same text in at most a quarter of the
updates, and health, stats and an orderly close.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from qwen_chat.chat_types import Busy, CancelToken, ChatMessage, ContextTooLong, GenerationSettings, InvalidInput
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.core.chat_engine import ChatEngine
from qwen_chat.engine.output.updates import merge_updates
from qwen_chat.chat_types import StreamUpdate
from tests.support.servers import engine_link
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

IMAGE = Path(__file__).parents[1] / "fixtures" / "images" / "chelsea.png"
GREEDY = GenerationSettings.preset(False, temperature=0.0, seed=0, max_new_tokens=12)
SLOTS = 16


def user(text: str, *images: str) -> ChatMessage:
    return ChatMessage(role="user", text=text, images=tuple(images))


@pytest.fixture(scope="module")
def runner_and_sampler(tiny_loaded):
    runner = ModelRunner(tiny_loaded.model, num_slots=SLOTS, max_context=1024, device="cpu")
    return runner, Sampler(SLOTS, runner.vocab_size, "cpu")


@pytest.fixture
def engine(tiny_loaded, runner_and_sampler):
    runner, sampler = runner_and_sampler
    for slot in range(runner.num_slots):
        runner.free(slot)
    engine = ChatEngine(tiny_loaded, runner, LocalExecutor(runner, sampler), image_token_budget=64,
                        max_context=1024, max_queue=80, num_slots=SLOTS, conversation_cache=False)
    engine.self_check({"tokens": [0], "checksum": 0.0})
    yield engine
    engine.close()


def timeless(updates):
    """The updates without the engine's own timing (time to the first token)."""
    return [replace(u, ttft_s=None) for u in updates]


def final_texts(updates) -> dict:
    """{choice: (reasoning, answer, finish_reason, completion_tokens)} of each choice's last update."""
    return {u.index: (u.reasoning, u.answer, u.finish_reason, u.completion_tokens) for u in updates
            if u.finish_reason is not None}


def test_replies_over_the_link_equal_the_engine_in_process(engine):
    cases = [([user("Hello there")], GREEDY),
             ([user("what is this?", str(IMAGE))], GREEDY),
             ([user("two choices")], replace(GREEDY, temperature=0.8, n=2, seed=5, top_logprobs=2))]
    direct = [timeless(engine.stream_chat(m, s, CancelToken())) for m, s in cases]
    with engine_link(engine) as client:
        remote = [timeless(client.stream_chat(m, s, CancelToken())) for m, s in cases]
    for d, r in zip(direct, remote):
        assert final_texts(r) == final_texts(d)
        assert "".join(u.answer_delta + u.reasoning_delta for u in r if u.index == 0) == \
            "".join(u.answer_delta + u.reasoning_delta for u in d if u.index == 0)
    for index in (0, 1):
        lp_direct = [(e.token, round(e.logprob, 5)) for u in direct[2] if u.index == index for e in u.logprobs]
        lp_remote = [(e.token, round(e.logprob, 5)) for u in remote[2] if u.index == index for e in u.logprobs]
        assert lp_remote == lp_direct and len(lp_remote) == 12
    assert final_texts(remote[2])[1][3] == 12  # both choices counted their tokens


def test_64_api_streams_and_4_page_users_each_equal_their_solo_run(engine):
    prompts = [[user(f"question number {i}: " + "word " * (i % 7))] for i in range(64)]
    with engine_link(engine) as client:
        solo = [final_texts(client.stream_chat(p, GREEDY, CancelToken())) for p in prompts[:8]]

        async def one(p):
            return final_texts([u async for u in await client.astream_chat(p, GREEDY, CancelToken())])

        async def all_at_once():
            return await asyncio.gather(*(one(p) for p in prompts))

        ui_prompts = [[user(f"page user {i} asks")] for i in range(4)]
        ui_solo = [final_texts(client.stream_chat(p, GREEDY, CancelToken())) for p in ui_prompts]
        ui_together: dict = {}
        ui_threads = [threading.Thread(target=lambda i=i: ui_together.__setitem__(
            i, final_texts(client.stream_chat(ui_prompts[i], GREEDY, CancelToken())))) for i in range(4)]
        for t in ui_threads:  # 4 page users (their handlers' threads) at the same time as 64 API streams
            t.start()
        together = asyncio.run(all_at_once())
        for t in ui_threads:
            t.join(120)
        assert [ui_together[i] for i in range(4)] == ui_solo
        assert together[:8] == solo  # batching with 63 others changes nothing
        assert len({t[0][1] + t[0][0] for t in together}) > 8  # different prompts, different replies
        wait_until(lambda: engine.scheduler.stats()["active"] == 0, 10, "every slot to be free again")


def test_refusals_come_before_any_update(engine):
    with engine_link(engine) as client:
        with pytest.raises(ContextTooLong):
            client.stream_chat([user("word " * 2000)], replace(GREEDY, max_new_tokens=64), CancelToken())
        with pytest.raises(InvalidInput, match="top_p"):
            client.stream_chat([user("x")], GenerationSettings(top_p=0.0), CancelToken())
        engine.scheduler._batch.max_queue = 0
        held = [client.stream_chat([user(f"hold {i}")], replace(GREEDY, max_new_tokens=400), CancelToken())
                for i in range(SLOTS)]
        with pytest.raises(Busy):
            asyncio.run(client.astream_chat([user("one more")], GREEDY, CancelToken()))
        for stream in held:
            stream.close()


def test_stop_and_a_closed_stream_free_the_slot(engine):
    long = replace(GREEDY, max_new_tokens=500)
    with engine_link(engine) as client:
        cancel = CancelToken()
        stream = client.stream_chat([user("stop me")], long, cancel)
        next(stream)
        cancel.cancel()
        assert list(stream)[-1].finish_reason == "cancelled"

        async def read_two_then_close():
            updates = await client.astream_chat([user("close me")], long, CancelToken())
            await anext(updates)
            await anext(updates)
            await updates.aclose()

        asyncio.run(read_two_then_close())
        wait_until(lambda: engine.scheduler.stats()["active"] == 0, 10, "the closed stream to leave the batch")
        assert engine.scheduler.stats()["totals"]["finished"]["cancelled"] >= 2


def test_a_slow_reader_gets_merged_deltas_with_the_same_text(engine):
    settings = replace(GREEDY, max_new_tokens=40)
    with engine_link(engine) as client:
        fast = list(client.stream_chat([user("read me")], settings, CancelToken()))
        slow = []
        stream = client.stream_chat([user("read me")], settings, CancelToken())
        for update in stream:
            slow.append(update)
            time.sleep(0.3)  # tokens arrive much faster than this reader reads
    text = lambda us: "".join(u.reasoning_delta + u.answer_delta for u in us)  # noqa: E731
    assert text(slow) == text(fast) and final_texts(slow) == final_texts(fast)
    assert len(slow) < len(fast) / 2


def test_stream_interval_4_gives_the_same_text_in_a_quarter_of_the_updates(engine):
    settings = replace(GREEDY, max_new_tokens=40)
    every = list(engine.stream_chat([user("interval")], settings, CancelToken()))  # the reference text
    with engine_link(engine, stream_interval=4) as client:
        grouped = list(client.stream_chat([user("interval")], settings, CancelToken()))
    text = lambda us: "".join(u.reasoning_delta + u.answer_delta for u in us)  # noqa: E731
    assert text(grouped) == text(every) and final_texts(grouped) == final_texts(every)
    tokens = grouped[-1].completion_tokens
    # at interval 1 a reader that keeps up gets up to one update per token; at 4, one per 4 tokens and the last
    assert tokens == 40 and len(grouped) <= tokens / 4 + 1


def test_health_stats_and_an_orderly_close(engine):
    with engine_link(engine) as client:
        assert client.health()["ok"] and client.info.name == engine.info.name
        wait_until(lambda: client.stats().get("num_slots") == SLOTS, 5, "a status")
        assert client.memory_report() == engine.memory_report()
        client.close()
        assert client.closed.is_set()
    assert not engine.health()["ok"]  # the front's close closed the engine


def test_merging_keeps_order_and_the_last_update_last():
    ups = [StreamUpdate(answer="a", answer_delta="a"), StreamUpdate(index=1, answer="x", answer_delta="x"),
           StreamUpdate(answer="ab", answer_delta="b", completion_tokens=2),
           StreamUpdate(answer="ab", finish_reason="stop", completion_tokens=3),
           StreamUpdate(index=1, answer="xy", answer_delta="y")]
    merged = merge_updates(ups)
    assert [(u.index, u.answer_delta, u.finish_reason) for u in merged] == \
        [(0, "ab", "stop"), (1, "xy", None)]
    assert merged[0].completion_tokens == 3
    lagging = [StreamUpdate(reasoning="r", reasoning_delta="r", thinking=True, logprobs=("l1",)),
               StreamUpdate(reasoning="r", answer="A", answer_delta="A", logprobs=("l2", "l3")),
               StreamUpdate(reasoning="r", answer="AB", answer_delta="B", completion_tokens=4, logprobs=("l4",))]
    [one] = merge_updates(lagging)
    assert (one.reasoning_delta, one.answer_delta, one.logprobs) == ("r", "AB", ("l1", "l2", "l3", "l4"))
    assert (one.answer, one.thinking, one.completion_tokens) == ("AB", False, 4)
    assert merge_updates(lagging[:1]) == lagging[:1]
