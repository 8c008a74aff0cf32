"""Non-finite logits at run time, on the real engine of the tiny model (CPU) behind the API and the chat page's
controller: a hook makes one sequence's logits NaN mid-reply.  That reply ends with a clear error (an SSE
error event then ``[DONE]``; a 500 ``generation_error`` body; on the page a notice and the reply saved as
*error*), a reply decoded in the same steps completes normally, ``/metrics`` counts each one, and no JSON the
service sends holds NaN."""
from __future__ import annotations

import json
import threading
from collections import defaultdict
from dataclasses import replace

import httpx
import pytest

from qwen_chat.chat_types import GenerationSettings
from qwen_chat.config import ServiceConfig
from qwen_chat.history.store import HistoryStore
from qwen_chat.web.handlers import ChatController, Session
from tests.support.metrics import scrape
from tests.support.servers import RunningServer, api_app, engine_link
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: loads the tiny model and decodes on CPU

POISON_SEED = 666  # the request sampled with this seed gets NaN logits (``NanHook``)
MESSAGE = "invalid numbers (NaN or infinity)"  # part of what the user reads
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
NORMAL_TOKENS = 120  # the normal reply's length: it is still decoding when the poisoned reply starts
METRIC = ("qwen_chat_engine_nonfinite_logits_total", ())


class NanHook:
    """Wraps a ``ModelRunner``: the decode logits of the sequence started with ``POISON_SEED`` become NaN from its
    ``after``-th decode step on, but only in a step that decodes at least ``min_batch`` sequences (so a test
    knows another reply shared the poisoned steps).  ``shared``: the batch size of every poisoned step."""

    def __init__(self, runner, after: int = 3, min_batch: int = 2) -> None:
        self.after, self.min_batch = after, min_batch
        self.slots: set[int] = set()
        self.steps: dict[int, int] = defaultdict(int)
        self.shared: list[int] = []
        prefill, decode = runner.prefill_batch, runner.decode

        def prefill_batch(chunks):
            for item in chunks:
                if item.first and not item.resume:
                    self.steps[item.slot] = 0
                    if item.sampling is not None and item.sampling.seed == POISON_SEED:
                        self.slots.add(item.slot)
                    else:
                        self.slots.discard(item.slot)
            return prefill(chunks)

        def poisoned_decode(slots, tokens, token_table=None):
            logits = decode(slots, tokens, token_table=token_table)
            for row, slot in enumerate(slots):
                if slot in self.slots:
                    self.steps[slot] += 1
                    if self.steps[slot] > self.after and len(slots) >= self.min_batch:
                        logits[row] = float("nan")
                        self.shared.append(len(slots))
            return logits

        runner.prefill_batch, runner.decode = prefill_batch, poisoned_decode


def strict_json(text: str):
    """``json.loads`` that refuses NaN and Infinity (which are not JSON: RFC 8259, section 6)."""
    def refuse(name):
        raise AssertionError(f"{name} in the service's JSON: {text[:200]}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def served(tiny_loaded, tmp_path_factory):
    from qwen_chat.engine.startup.runner_setup import build_engine

    cfg = ServiceConfig(model="tiny", history_dir=tmp_path_factory.mktemp("history"), max_batch=2,
                        max_queue=4, max_context=2048)
    engine = build_engine(tiny_loaded, cfg)
    hook = NanHook(engine.runner)
    try:
        with engine_link(engine, cfg.stream_interval) as client:
            app, _ = api_app(client, cfg)
            with RunningServer(app) as server:
                yield server.url, engine, client, hook
    finally:
        engine.close()


def chat(url: str, seed: int, max_tokens: int, stream: bool) -> httpx.Response:
    """One chat completion (sampled, with log-probabilities); the prompt differs by seed (a reply's kept prompt
    state would hold the second of only two state rows, and an identical prompt would wait for that row)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me about the sea ({seed})."}],
            "temperature": 1.0, "seed": seed, "max_tokens": max_tokens, "stream": stream, "logprobs": True,
            "top_logprobs": 2, **NO_THINK}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def beside_a_long_reply(url: str, engine, run):
    """Start a normal ``NORMAL_TOKENS`` reply (non-streamed, with log-probabilities), call ``run()`` once it decodes, and
    return (what ``run`` returned, the normal reply's response)."""
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("normal", chat(url, 1, NORMAL_TOKENS, stream=False)))
    worker.start()
    wait_until(lambda: engine.stats()["running"] >= 1, timeout_s=60, what="the normal reply decoding")
    got = run()
    worker.join(120)
    return got, box["normal"]


def assert_normal(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    body = strict_json(response.text)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == NORMAL_TOKENS
    assert choice["message"]["content"] and len(choice["logprobs"]["content"]) == NORMAL_TOKENS


def test_streamed_reply_with_nan_logits_ends_with_an_error_event_and_others_go_on(served):
    url, engine, _, hook = served
    before = scrape(url).get(METRIC, 0.0)
    stream, normal = beside_a_long_reply(url, engine, lambda: chat(url, POISON_SEED, 60, stream=True))
    assert hook.shared and min(hook.shared) >= 2  # the poisoned steps decoded the normal reply too
    assert stream.status_code == 200
    events = [line[len("data: "):] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [strict_json(e) for e in events[:-1]]
    error = chunks[-1]["error"]
    assert MESSAGE in error["message"] and (error["type"], error["code"]) == ("server_error", "generation_error")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c.get("choices"))
    assert text  # what came before the fault (the first token and 3 decoded ones) went out
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])  # never "stop" or "length"
    assert_normal(normal)
    assert scrape(url)[METRIC] == before + 1


def test_non_streamed_reply_with_nan_logits_is_a_500_naming_the_fault(served):
    url, engine, _, hook = served
    before = scrape(url)[METRIC]
    reply, normal = beside_a_long_reply(url, engine, lambda: chat(url, POISON_SEED, 60, stream=False))
    assert reply.status_code == 500
    error = strict_json(reply.text)["error"]
    assert MESSAGE in error["message"] and (error["type"], error["code"]) == ("server_error", "generation_error")
    assert_normal(normal)
    assert scrape(url)[METRIC] == before + 1
    assert httpx.get(url + "/healthz").status_code == 200  # one bad sequence does not take the service down


def test_page_shows_the_fault_saves_the_reply_as_error_and_the_next_turn_works(served, tmp_path):
    url, _, client, hook = served
    hook.min_batch = 1  # the page's turn alone in its steps
    try:
        ctl = ChatController(client, HistoryStore(tmp_path), save_interval_s=0.05, ui_interval_s=0.0)
        settings = replace(GenerationSettings.preset(False), temperature=1.0, max_new_tokens=64, seed=POISON_SEED)
        views = list(ctl.send("local", None, "Tell me about the sea.", [], "", settings, Session()))
        assert MESSAGE in views[-1].notice
        conv_id = views[-1].conv_id
        reply = ctl.store.user("local").load(conv_id).messages[-1]
        assert reply.status == "error" and MESSAGE in reply.notice and reply.text
        again = list(ctl.send("local", conv_id, "And the mountains?", [], "", replace(settings, seed=7),
                              Session()))
        saved = ctl.store.user("local").load(conv_id).messages
        assert again[-1].done and saved[-1].status in ("complete", "length") and len(saved) == 4
    finally:
        hook.min_batch = 2
