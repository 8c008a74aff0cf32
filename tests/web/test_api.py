"""OpenAI-compatible API (qwen_chat.web.api) driven by the official ``openai`` client against a real uvicorn
server in a background thread, with the scripted ``FakeBackend`` (tests/support/fake_backend.py)."""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import threading
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from qwen_chat.config import ServiceConfig
from tests.support.fake_backend import FakeBackend
from tests.support.metrics import scrape
from tests.support.servers import RunningServer, api_app, hang_up_after
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "images"


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


MODEL = "fake"  # the model id every test server serves (a request naming another id gets 404)


class Server:
    def __init__(self, backend: FakeBackend, cfg: ServiceConfig, model: str = MODEL):
        cfg = dataclasses.replace(cfg, model=model)
        self.backend = backend
        self.cfg = cfg
        self.app, self.instrumented = api_app(backend, cfg)
        self._server = RunningServer(self.app)

    def __enter__(self) -> "Server":
        self.url = self._server.__enter__().url
        return self

    def __exit__(self, *exc) -> None:
        self._server.__exit__(*exc)

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30, **kwargs)


@pytest.fixture
def server(tmp_path):
    with Server(FakeBackend(), ServiceConfig(model="fake", history_dir=tmp_path / "history")) as srv:
        yield srv


@pytest.fixture
def client(server):
    return server.client()


USER = [{"role": "user", "content": "hello there"}]


# ------------------------------------------------------------------------------------------ happy paths


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["fake"]  # --model as given
    assert models[0].root == "fake-qwen" and models[0].max_model_len == 256
    assert client.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_text_chat_reasoning_separate_and_usage(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=USER, seed=7)
    choice = reply.choices[0]
    assert reply.model == "fake"
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant"
    assert choice.message.content.startswith("You said: hello there [0 image(s)] [1 messages]")
    assert choice.message.reasoning_content.startswith("Thinking about it:")
    assert "Thinking" not in choice.message.content
    call = server.backend.calls[-1]
    assert reply.usage.prompt_tokens == 2  # "hello there": one fake token per word
    assert reply.usage.completion_tokens == call.steps == 7 + 12  # 3+4 reasoning words; 6 head + 6 filler answer words
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # thinking on by default with the model-card thinking preset
    s = call.settings
    assert (s.enable_thinking, s.temperature, s.top_p, s.top_k, s.presence_penalty) == (True, 1.0, 0.95, 20, 1.5)


def test_streamed_chat_chunks_then_finish(server, client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, seed=11, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:-1] if c.choices[0].delta.content]
    reasoning = [c.choices[0].delta.reasoning_content for c in chunks[1:-1]
                 if getattr(c.choices[0].delta, "reasoning_content", None)]
    assert len(content) >= 5 and len(reasoning) >= 3
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1
    whole = client.chat.completions.create(model=MODEL, messages=USER, seed=11)
    assert "".join(content) == whole.choices[0].message.content
    assert "".join(reasoning) == whole.choices[0].message.reasoning_content


def test_stream_usage_chunk_when_asked(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 2
    assert chunks[-1].usage.completion_tokens == 12  # no reasoning tokens with thinking off
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": USER, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    final = json.loads(lines[-2][len("data: "):])
    assert final["choices"][0]["finish_reason"] == "stop" and final["choices"][0]["delta"] == {}


def test_thinking_off_has_no_reasoning_and_uses_non_thinking_preset(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=USER,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content.startswith("You said: hello there")
    assert getattr(message, "reasoning_content", None) is None
    s = server.backend.calls[-1].settings
    assert (s.enable_thinking, s.temperature, s.top_p, s.top_k, s.presence_penalty) == (False, 0.7, 0.8, 20, 1.5)
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=USER, stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in streamed if c.choices)


def test_parameters_reach_the_backend(server, client):
    client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=100, temperature=0.3, top_p=0.5, presence_penalty=0.0,
        seed=42, stop=["END", "###"], extra_body={"top_k": 5},
    )
    s = server.backend.calls[-1].settings
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.presence_penalty, s.seed, s.stop) == (
        100, 0.3, 0.5, 5, 0.0, 42, ("END", "###"))
    client.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=200, stop="STOP")
    s = server.backend.calls[-1].settings
    assert (s.max_new_tokens, s.stop) == (200, ("STOP",))


def test_length_finish_reason(tmp_path):
    with Server(FakeBackend(answer_words=200), ServiceConfig(history_dir=tmp_path)) as srv:
        client = srv.client()
        reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 64
        chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"


def test_system_and_multi_turn_messages(server, client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "first"}]},
        {"role": "assistant", "content": "answer one", "reasoning_content": "secret thoughts"},
        {"role": "user", "content": "second question"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages)
    assert "You said: second question" in reply.choices[0].message.content
    assert "[4 messages]" in reply.choices[0].message.content
    sent = server.backend.calls[-1].messages
    assert [(m.role, m.text) for m in sent] == [
        ("system", "You are terse."), ("user", "first"), ("assistant", "answer one"), ("user", "second question")]
    assert all(m.reasoning == "" for m in sent)  # the earlier reasoning is never sent back


def test_leading_system_messages_are_merged_and_numbers_normalised(server):
    resp = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "stream": None, "max_tokens": 100.0, "top_k": 5.0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."},
                     {"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    call = server.backend.calls[-1]
    assert [(m.role, m.text) for m in call.messages] == [("system", "Be brief.\n\nBe kind."), ("user", "hi")]
    assert type(call.settings.max_new_tokens) is int and call.settings.max_new_tokens == 100
    assert type(call.settings.top_k) is int and call.settings.top_k == 5


def test_image_question_with_data_url(server, client, tmp_path):
    png = (FIXTURES / "coffee.png").read_bytes()
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": data_url(png)}}]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    with Image.open(io.BytesIO(png)) as original:
        size = original.size
    # coffee.png is small enough for the default 1024-token budget: the model sees it at its own size
    assert f"[1 image(s) {size[0]}x{size[1]}]" in reply.choices[0].message.content
    path = Path(server.backend.calls[-1].messages[-1].images[0])
    assert path.parent == tmp_path / "history" / "api_images"
    with Image.open(path) as im:
        assert (im.format, im.mode, im.size) == ("PNG", "RGB", size)
    # the same image sent again (clients resend history) maps to the same file
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    assert server.backend.calls[-1].messages[-1].images[0] == str(path)
    assert len(list(path.parent.glob("*.png"))) == 1


def test_big_jpeg_is_downscaled_to_the_token_budget(tmp_path):
    cfg = ServiceConfig(history_dir=tmp_path, image_token_budget=64)
    with Server(FakeBackend(), cfg) as srv:
        jpg = (FIXTURES / "rocket.jpg").read_bytes()
        content = [{"type": "image_url", "image_url": {"url": data_url(jpg, "image/jpeg")}}]
        srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
        with Image.open(srv.backend.calls[-1].messages[-1].images[0]) as im:
            assert im.size[0] * im.size[1] <= 64 * 32 * 32


def test_seed_reproducible_at_temperature_above_zero(client):
    def ask(seed):
        r = client.chat.completions.create(model=MODEL, messages=USER, temperature=1.0, seed=seed)
        return r.choices[0].message.content, r.choices[0].message.reasoning_content

    assert ask(1234) == ask(1234)
    assert ask(1234) != ask(4321)


# -------------------------------------------------------------------------------------------- bad input


def bad_request(client, **kwargs) -> openai.BadRequestError:
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("messages", USER)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize("params, param, range_text", [
    ({"top_p": 0}, "top_p", "[0.1, 1.0]"),
    ({"top_p": 1.5}, "top_p", "[0.1, 1.0]"),
    ({"extra_body": {"top_k": 0}}, "top_k", "[1, 100]"),
    ({"temperature": 2.5}, "temperature", "[0.0, 1.5]"),
    ({"temperature": -0.1}, "temperature", "[0.0, 1.5]"),
    ({"presence_penalty": 3}, "presence_penalty", "[0.0, 2.0]"),
    ({"max_tokens": 0}, "max_tokens", "[1, 8192]"),
    ({"max_completion_tokens": 100000}, "max_completion_tokens", "[1, 8192]"),
    ({"n": 9}, "n", "[1, 8]"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2.0, 2.0]"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"extra_body": {"thinking_token_budget": -1}}, "thinking_token_budget", "[0, 8192]"),
    ({"seed": -1}, "seed", "[0, 2**63-1]"),
])
def test_out_of_range_parameters_are_400_with_the_range(server, client, params, param, range_text):
    calls_before = len(server.backend.calls)
    err = bad_request(client, **params)
    assert err.param == param
    assert range_text in err.message and param in err.message
    assert len(server.backend.calls) == calls_before  # never reached the engine, never clamped


@pytest.mark.parametrize("messages, needle", [
    ([], "non-empty"),
    ([{"role": "user", "content": "   \n\t"}], "empty"),
    ([{"role": "user", "content": "\u200b"}], "empty"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "last message"),
    ([{"role": "tool", "content": "x", "tool_call_id": "1"}], "must follow an assistant message with tool_calls"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
      {"role": "tool", "content": "x", "tool_call_id": "c1"}], "must be a JSON object"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}, {"role": "user", "content": "x"}],
     "system message can only come first"),
    ([{"role": "user", "content": "\u200d\ufeff "}], "empty"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "not supported"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
      {"role": "user", "content": "hi"}], "only accepted in user messages"),
])
def test_bad_messages_are_400(client, messages, needle):
    err = bad_request(client, messages=messages)
    assert needle in err.message


@pytest.mark.parametrize("url, needle", [
    ("data:image/png;base64,not*base64!", "not valid base64"),
    (data_url(b"hello, this is a text file", "image/png"), "not a valid image"),
    (data_url(b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>', "image/svg+xml"),
     "not a valid image"),
    (data_url(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "image/heic"), "HEIC is not supported"),
    (data_url((FIXTURES / "rocket.jpg").read_bytes()[:5000], "image/jpeg"), "not a valid image"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("http://example.com/cat.png", "remote image URLs are disabled"),
    ("file:///etc/passwd", "unsupported image URL scheme"),
])
def test_bad_images_are_400(server, client, url, needle):
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
    err = bad_request(client, messages=[{"role": "user", "content": content}])
    assert needle in err.message
    assert "messages[0].content[1].image_url" in err.message
    assert err.param == "messages[0].content[1].image_url"
    # the server stays usable
    assert server.client().chat.completions.create(model=MODEL, messages=USER).choices[0].finish_reason == "stop"


def test_remote_images_when_allowed(tmp_path):
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(FIXTURES))
    handler.log_message = lambda *a: None
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    try:
        with Server(FakeBackend(), ServiceConfig(history_dir=tmp_path, allow_remote_images=True)) as srv:
            client = srv.client()
            part = {"type": "image_url", "image_url": {"url": base + "/coffee.png"}}
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}])
            with Image.open(FIXTURES / "coffee.png") as im:
                assert f"[1 image(s) {im.size[0]}x{im.size[1]}]" in reply.choices[0].message.content
            missing = {"type": "image_url", "image_url": {"url": base + "/missing.png"}}
            err = bad_request(client, messages=[{"role": "user", "content": [missing]}])
            assert "HTTP 404" in err.message
    finally:
        files.shutdown()


def test_too_many_images_is_400(tmp_path):
    with Server(FakeBackend(), ServiceConfig(history_dir=tmp_path, max_images_per_turn=2)) as srv:
        part = {"type": "image_url", "image_url": {"url": data_url((FIXTURES / "coffee.png").read_bytes())}}
        err = bad_request(srv.client(), messages=[{"role": "user", "content": [part, part, part]}])
        assert "3 images in one message; max 2" in err.message


def test_prompt_too_long_is_400_with_token_counts(server, client):
    err = bad_request(client, messages=[{"role": "user", "content": "word " * 300}])
    assert err.code == "context_length_exceeded"
    assert "300" in err.message and "256" in err.message
    assert "max_tokens" in err.message and "new chat" not in err.message


def test_context_message_replaces_the_ui_advice():
    from qwen_chat.chat_types import ContextTooLong
    from qwen_chat.web.api.protocol import CONTEXT_ADVICE, context_message

    ui = ("The message is too long for the model's context: the prompt needs 300 tokens, plus at least 64 for "
          "the reply, but the context holds 256 tokens. Shorten the message or system prompt, attach fewer or "
          "smaller images, or start a new chat.")
    message = context_message(ContextTooLong(ui, prompt_tokens=300, context_length=256), ui)
    assert "new chat" not in message and message.endswith("holds 256 tokens. " + CONTEXT_ADVICE)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("extra, needle, param", [
    ({"logit_bias": {"1": 5}}, "logit_bias", "logit_bias"),
    ({"response_format": {"type": "regex", "regex": "a+"}}, "json_schema", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema",
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "not a valid JSON schema", "response_format.json_schema.schema"),
    ({"functions": [{"name": "f"}]}, "deprecated", "functions"),
    ({"function_call": "auto"}, "deprecated", "function_call"),
    ({"tools": [{"type": "web_search"}]}, "function", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "characters", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "object",
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "same name", "tools"),
    ({"tool_choice": "required"}, "needs tools", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "no tool is named",
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined",
     "response_format"),
])
def test_unsupported_or_malformed_tools_and_formats_are_refused(client, extra, needle, param):
    err = bad_request(client, **extra)
    assert needle in err.message and err.param == param
    legacy = param in ("logit_bias", "functions", "function_call")
    assert err.code == ("unsupported_parameter" if legacy else "invalid_input")


@pytest.mark.parametrize("extra", [{"functions": [{"name": "f"}]}, {"function_call": "auto"},
                                   {"logit_bias": {"1": 5}}])
def test_unsupported_parameters_share_one_code(client, extra):
    assert bad_request(client, **extra).code == "unsupported_parameter"


def test_tools_and_formats_reach_the_backend(server, client):
    client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], parallel_tool_calls=False,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    s = server.backend.calls[-1].settings
    assert (s.tools[0].name, s.tool_choice, s.forced_tool, s.parallel_tool_calls) == (
        "get_weather", "required", "get_weather", False)
    assert s.tools[0].parameters["required"] == ["city"]
    client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"})
    assert server.backend.calls[-1].settings.json_schema == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(model=MODEL, messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert server.backend.calls[-1].settings.json_schema == schema


def test_small_max_tokens_and_the_new_fields_reach_the_backend(server, client):
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, n=2, frequency_penalty=-0.5,
                                   logprobs=True, top_logprobs=3, extra_body={"thinking_token_budget": 16})
    s = server.backend.calls[-1].settings
    assert (s.max_new_tokens, s.n, s.frequency_penalty, s.top_logprobs, s.thinking_token_budget) == (1, 2, -0.5, 3, 16)
    client.chat.completions.create(model=MODEL, messages=USER, logprobs=True)
    assert server.backend.calls[-1].settings.top_logprobs == 0
    client.chat.completions.create(model=MODEL, messages=USER, logprobs=False)
    assert server.backend.calls[-1].settings.top_logprobs is None


def test_conflicting_token_limits_and_top_logprobs_alone_are_400(server, client):
    err = bad_request(client, max_tokens=100, max_completion_tokens=200)
    assert err.param == "max_tokens" and "differ" in err.message and err.code == "conflicting_parameters"
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, max_completion_tokens=100)
    assert server.backend.calls[-1].settings.max_new_tokens == 100
    err = bad_request(client, top_logprobs=2)
    assert err.param == "top_logprobs" and "logprobs" in err.message


def test_unknown_model_is_404_and_the_documented_aliases_are_served(tmp_path):
    with Server(FakeBackend(), ServiceConfig(history_dir=tmp_path), model="/models/Qwen3.5-9B") as srv:
        client = srv.client()
        for alias in ("/models/Qwen3.5-9B", "Qwen3.5-9B", "Qwen/Qwen3.5-9B", "fake-qwen"):
            assert client.chat.completions.create(model=alias, messages=USER).model == "/models/Qwen3.5-9B"
        assert client.models.retrieve("Qwen/Qwen3.5-9B").id == "/models/Qwen3.5-9B"
        calls = len(srv.backend.calls)
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4", messages=USER)
        assert info.value.code == "model_not_found" and info.value.param == "model"
        assert "gpt-4" in info.value.message and len(srv.backend.calls) == calls


@pytest.mark.parametrize("content, param", [
    ("\\ud800x", "messages[0].content"),
    ('[{"type": "text", "text": "ok"}, {"type": "text", "text": "a\\udfffb"}]', "messages[0].content[1].text"),
])
def test_lone_surrogate_is_400_naming_the_field(server, content, param):
    text = content if content.startswith("[") else f'"{content}"'
    body = '{"model": "fake", "messages": [{"role": "user", "content": ' + text + '}]}'
    resp = httpx.post(server.url + "/v1/chat/completions", content=body.encode(),
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]
    assert server.backend.calls == []


def test_invalid_json_body_is_400_in_openai_shape(server):
    resp = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "the request body is not valid JSON"
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------- keys, busy, not ready


def test_api_keys_401(tmp_path):
    cfg = ServiceConfig(history_dir=tmp_path, api_keys=("sk-right",))
    with Server(FakeBackend(), cfg) as srv:
        with pytest.raises(openai.AuthenticationError) as info:
            srv.client("sk-wrong").chat.completions.create(model=MODEL, messages=USER)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            srv.client("sk-wrong").models.list()
        resp = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": USER})
        assert resp.status_code == 401 and "missing API key" in resp.json()["error"]["message"]
        assert srv.backend.calls == []
        reply = srv.client("sk-right").chat.completions.create(model=MODEL, messages=USER)
        assert reply.choices[0].finish_reason == "stop"
        assert httpx.get(srv.url + "/healthz").status_code == 200  # ops endpoints need no key


def test_no_key_needed_on_loopback_without_keys(client):
    assert client.chat.completions.create(model=MODEL, messages=USER).choices[0].finish_reason == "stop"


def test_queue_full_is_429(tmp_path):
    backend = FakeBackend(capacity=1, answer_words=500, step_delay_s=0.01)
    with Server(backend, ServiceConfig(history_dir=tmp_path)) as srv:
        client = srv.client()
        stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=USER)
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "1"
        stream.close()


def test_not_ready_is_503_then_ok(tmp_path):
    backend = FakeBackend(ready=False)
    with Server(backend, ServiceConfig(history_dir=tmp_path)) as srv:
        with pytest.raises(openai.InternalServerError) as info:
            srv.client().chat.completions.create(model=MODEL, messages=USER)
        assert info.value.status_code == 503
        assert (info.value.body["type"], info.value.body["code"]) == ("server_error", "not_ready")
        assert info.value.response.headers["retry-after"] == "10"
        health = httpx.get(srv.url + "/healthz")
        assert health.status_code == 503 and health.json() == {"status": "unavailable", "reason": "loading model"}
        backend.ready = True
        assert httpx.get(srv.url + "/healthz").json() == {"status": "ok"}
        assert srv.client().chat.completions.create(model=MODEL, messages=USER).choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------------ cancellation


def test_stream_cancelled_midway_frees_the_queue(tmp_path):
    backend = FakeBackend(capacity=1, reasoning_words=0, answer_words=2000, step_delay_s=0.01)
    with Server(backend, ServiceConfig(history_dir=tmp_path)) as srv:
        client = srv.client()
        stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True, max_tokens=8192)
        hang_up_after(stream, 5)
        assert wait_until(lambda: backend.active == 0), "generation kept running after the client left"
        first = backend.calls[0]
        assert first.finish_reason == "cancelled"
        assert first.steps < 2000
        # the single slot is free again: the next request is served, not refused with 429
        backend.answer_words = 3
        reply = client.chat.completions.create(model=MODEL, messages=USER)
        assert reply.choices[0].finish_reason == "stop"
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'qwen_chat_finished_total{finish_reason="cancelled"} 1.0' in metrics


class ShutdownBackend(FakeBackend):
    """The engine draining its streams at a service shutdown: after ``cut_after`` updates the stream ends as
    "cancelled" through the engine's own token, while the request's token stays untouched."""

    cut_after: int = 3

    def stream_chat(self, messages, settings, cancel):
        from qwen_chat.chat_types import CancelToken

        engine_token = CancelToken()
        updates = super().stream_chat(messages, settings, engine_token)

        def drained():
            for count, update in enumerate(updates, start=1):
                if count == self.cut_after:
                    engine_token.cancel()
                yield update
        return drained()


def test_stream_cut_by_shutdown_ends_with_an_error_event(tmp_path):
    backend = ShutdownBackend(reasoning_words=0, answer_words=50)
    with Server(backend, ServiceConfig(history_dir=tmp_path)) as srv:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": USER, "stream": True}) as resp:
            events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == {"error": {
            "message": "the service is shutting down; the reply was cut off", "type": "server_error",
            "param": None, "code": "service_unavailable"}}
        finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
        assert not any(finishes), "a cut-off reply must not look finished"
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in srv.client().chat.completions.create(model=MODEL, messages=USER, stream=True):
                pass
        assert backend.calls[0].finish_reason == "cancelled"


def test_non_streaming_reply_cut_by_shutdown_is_503(tmp_path):
    with Server(ShutdownBackend(reasoning_words=0, answer_words=50), ServiceConfig(history_dir=tmp_path)) as srv:
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={"model": MODEL, "messages": USER})
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "service_unavailable"
        assert "shutting down" in resp.json()["error"]["message"]


def test_non_streaming_client_disconnect_cancels(tmp_path):
    backend = FakeBackend(capacity=1, reasoning_words=0, answer_words=2000, step_delay_s=0.01)
    with Server(backend, ServiceConfig(history_dir=tmp_path)) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/chat/completions", timeout=0.5,
                       json={"model": MODEL, "messages": USER, "max_tokens": 8192})
        assert wait_until(lambda: backend.active == 0), "generation kept running after the client left"
        assert backend.calls[0].finish_reason == "cancelled" and backend.calls[0].steps < 2000


def test_concurrent_streams_do_not_mix(tmp_path):
    backend = FakeBackend(capacity=4, step_delay_s=0.005)
    with Server(backend, ServiceConfig(history_dir=tmp_path)) as srv:
        results: dict[str, str] = {}

        def ask(name: str) -> None:
            chunks = srv.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": name}], stream=True, temperature=0)
            results[name] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        threads = [threading.Thread(target=ask, args=(f"user{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == ["user0", "user1", "user2", "user3"]
        for name, text in results.items():
            assert text.startswith(f"You said: {name} [0 image(s)]")


# --------------------------------------------------------------------------------------------- metrics


def test_every_error_type_follows_its_status_and_code_names_the_reason(server):
    """One rule for ``error.type`` (OpenAI's types by HTTP status); ``code`` says what was wrong."""
    url = f"{server.url}/v1/chat/completions"
    cases = [(httpx.post(url, json={"messages": USER, "top_p": 0}), 400, "invalid_request_error", "out_of_range"),
             (httpx.post(url, json={"model": "nope", "messages": USER}), 404, "invalid_request_error",
              "model_not_found"),
             (httpx.post(url, content=b"{}", headers={"Content-Type": "text/plain"}), 415, "invalid_request_error",
              "unsupported_media_type"),
             (httpx.get(f"{server.url}/v1/nothing-here"), 404, "invalid_request_error", "unknown_route")]
    for response, status, type_, code in cases:
        assert response.status_code == status
        error = response.json()["error"]
        assert (error["type"], error["code"]) == (type_, code), error


def test_metrics_count_the_requests_made(server, client):
    client.chat.completions.create(model=MODEL, messages=USER)
    list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    bad_request(client, top_p=0)
    bad_request(client, messages=[{"role": "user", "content": "word " * 300}])
    refused = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": []}',
                         headers={"Content-Type": "text/plain"})
    assert refused.status_code == 415
    m = scrape(server.url)
    assert m[("qwen_chat_requests_total", ())] == 6
    assert m[("qwen_chat_errors_total", (("kind", "unsupported_media_type"),))] == 1
    assert m[("qwen_chat_errors_total", (("kind", "out_of_range"),))] == 1
    assert m[("qwen_chat_errors_total", (("kind", "context_too_long"),))] == 1
    assert m[("qwen_chat_finished_total", (("finish_reason", "stop"),))] == 3
    assert m[("qwen_chat_ttft_seconds_count", ())] == 3
    assert m[("qwen_chat_decode_tokens_per_second_count", ())] == 3
    assert m[("qwen_chat_active_streams", ())] == 0
    assert m[("qwen_chat_completion_tokens_total", ())] == 19 + 19 + 11
    assert m[("qwen_chat_gpu_memory_bytes", (("rank", "0"),))] == 1000
    assert m[("qwen_chat_gpu_memory_bytes", (("rank", "1"),))] == 2000
    assert m[("qwen_chat_queue_depth", ())] == 0
    assert m[("qwen_chat_healthy", ())] == 1
