"""The OpenAI-compatible API against the real ``ChatEngine`` on the built-in tiny model (random weights, CPU),
driven by the official ``openai`` client over a real uvicorn server."""
from __future__ import annotations

import base64
from pathlib import Path

import httpx
import openai
import pytest

from qwen_chat.config import ServiceConfig
from tests.support.metrics import scrape
from tests.support.servers import hang_up_after, serve_engine
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: loads the tiny model and decodes on CPU

COFFEE = Path(__file__).parents[1] / "fixtures" / "images" / "coffee.png"
USER = [{"role": "user", "content": "Tell me about the sea."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(tiny_loaded, tmp_path_factory):
    cfg = ServiceConfig(model="tiny", history_dir=tmp_path_factory.mktemp("history"), max_batch=2,
                        max_queue=4, max_context=2048, image_token_budget=64)
    with serve_engine(tiny_loaded, cfg) as served:
        yield served


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_and_models(served, client):
    url, engine = served
    health = httpx.get(url + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == 2048


def test_greedy_text_chat_streamed_equals_non_streamed(client):
    whole = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=64,
                                           extra_body=NO_THINK)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content
    assert getattr(choice.message, "reasoning_content", None) is None
    assert whole.usage.prompt_tokens > 5
    assert 1 <= whole.usage.completion_tokens <= 64
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=64,
                                                 stream=True, extra_body=NO_THINK))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 2
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert "".join(deltas) == choice.message.content


def test_thinking_on_keeps_reasoning_separate(client):
    reply = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=64)
    message = reply.choices[0].message
    # the random model rarely closes </think>: whatever it wrote inside the reasoning stays out of content
    assert message.reasoning_content
    assert "<think>" not in message.content and "</think>" not in message.content
    assert "</think>" not in message.reasoning_content
    assert reply.usage.completion_tokens <= 64


def test_image_question_with_data_url(client):
    url = "data:image/png;base64," + base64.b64encode(COFFEE.read_bytes()).decode()
    text_only = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is in this picture?"}],
        temperature=0, max_tokens=64, extra_body=NO_THINK)
    reply = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=64, extra_body=NO_THINK,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "What is in this picture?"}]}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    # the image adds its visual tokens (at most the 64-token budget) plus the vision start/end markers
    extra = reply.usage.prompt_tokens - text_only.usage.prompt_tokens
    assert 3 <= extra <= 64 + 2


def test_seed_reproducible_at_temperature_above_zero(client):
    def ask(seed):
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=1.0, seed=seed,
                                           max_tokens=64, extra_body=NO_THINK)
        return r.choices[0].message.content

    first = ask(1234)
    assert first == ask(1234)
    assert first != ask(99)


def test_out_of_range_and_too_long_prompt_are_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, top_p=0)
    assert "top_p" in info.value.message and "[0.1, 1.0]" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "sea " * 3000}],
                                       max_tokens=64)
    assert info.value.code == "context_length_exceeded"
    assert "2048" in info.value.message


def test_stream_cancelled_midway_frees_the_engine(served, client):
    url, engine = served
    stream = client.chat.completions.create(model="tiny", messages=USER, temperature=1.0, max_tokens=8192,
                                            stream=True, extra_body=NO_THINK)
    hang_up_after(stream, 3)
    assert wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["queue_depth"] == 0)
    finished = engine.stats().get("finished_cancelled_total", 0)
    assert finished >= 1
    reply = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=64,
                                           extra_body=NO_THINK)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_metrics_count_requests(served, client):
    url, _ = served

    def requests_total() -> float:
        return scrape(url)[("qwen_chat_requests_total", ())]

    before = requests_total()
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=64, extra_body=NO_THINK)
    list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=64, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=USER, extra_body={"top_k": 0})
    assert requests_total() == before + 3


def test_logprobs_greedy_chosen_is_top1_and_streamed_equals_non_streamed(client):
    ask = dict(model="tiny", messages=USER, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5,
               extra_body=NO_THINK)
    reply = client.chat.completions.create(**ask)
    entries = reply.choices[0].logprobs.content
    answered = reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")  # the stop token has none
    assert len(entries) == answered >= 1
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)  # greedy: the top-1
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or e.token.startswith("bytes:")
    assert "".join(e.token for e in entries).lstrip() == reply.choices[0].message.content  # (answer: no lead space)
    chunks = list(client.chat.completions.create(stream=True, **ask))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
    plain = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=8,
                                           extra_body=NO_THINK)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content


def test_max_tokens_one_gives_exactly_one_token(client):
    reply = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=1,
                                           extra_body=NO_THINK)
    assert reply.usage.completion_tokens == 1
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_n_choices_reproducible_with_a_seed_streamed_and_not(client):
    ask = dict(model="tiny", messages=USER, temperature=1.0, max_tokens=16, n=3, seed=77, extra_body=NO_THINK)
    first = client.chat.completions.create(**ask)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) == 3
    assert [c.message.content for c in client.chat.completions.create(**ask).choices] == texts
    assert first.usage.completion_tokens <= 3 * 16 and first.usage.completion_tokens >= 3
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    parts, finished = {0: "", 1: "", 2: ""}, set()
    for c in chunks:
        for choice in c.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert [parts[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens


def test_thinking_token_budget_closes_the_reasoning_and_the_answer_follows(client):
    reply = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40,
                                           extra_body={"thinking_token_budget": 6})
    message = reply.choices[0].message
    reasoning = reply.usage.completion_tokens_details.reasoning_tokens
    assert 1 <= reasoning <= 6 and message.reasoning_content
    assert message.content and reply.usage.completion_tokens > reasoning + 1  # </think>, then the answer
    unbounded = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=40)
    # the random model rarely closes its thinking by itself: without a budget it is all reasoning
    assert unbounded.usage.completion_tokens_details.reasoning_tokens > 6


def test_dropped_turns_are_reported(client):
    history = []
    for i in range(3):
        history += [{"role": "user", "content": f"turn {i} " + "sea " * 900},
                    {"role": "assistant", "content": "ok"}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=history + USER, temperature=0, max_tokens=64, extra_body=NO_THINK)
    reply = raw.parse()
    assert raw.headers["x-dropped-messages"] == str(reply.dropped_messages)
    # whole oldest turns (a user message and its reply) left out, until prompt + max_tokens fit the 2048
    assert reply.dropped_messages in (2, 4) and reply.usage.prompt_tokens + 64 <= 2048
    small = client.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=8,
                                                             extra_body=NO_THINK)
    assert small.headers["x-dropped-messages"] == "0" and "dropped_messages" not in small.parse().model_extra
