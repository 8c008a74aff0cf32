"""The API's limits and its OpenAI-shaped answers to malformed requests (fake backend): a body over
``--max-request-mb`` (413 from its Content-Length, before it is read), JSON nested too deeply (400, also inside a
schema or a message's content, never a 500), too many messages, NaN / Infinity (not JSON numbers),
``stream_options`` without ``stream``, a wrong method (405 with ``Allow``) and an unknown route (404 with an
OpenAI error body).  After each refusal a normal request is still answered."""
from __future__ import annotations

import socket

import httpx
import pytest

from qwen_chat.config import ServiceConfig
from qwen_chat.web.api.body import MAX_JSON_DEPTH, MAX_MESSAGES
from tests.support.fake_backend import FakeBackend
from tests.web.test_api import Server

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = ServiceConfig(model="fake", history_dir=tmp_path_factory.mktemp("h"), max_request_mb=1.0)
    with Server(FakeBackend(), cfg) as srv:
        yield srv


def post(server, body: bytes | dict) -> httpx.Response:
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    return httpx.post(server.url + "/v1/chat/completions", timeout=30, **kwargs)


def refused(r: httpx.Response, status: int, words: str) -> dict:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    return error


def still_serving(server) -> None:
    assert post(server, {"messages": USER, "max_tokens": 4}).status_code == 200


def test_a_body_over_the_limit_is_refused_413_before_it_is_read(server):
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (2 * 2**20))  # the body itself is never sent
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"larger than the limit of 1.0 MB" in answer
    refused(post(server, b'{"messages": "' + b"x" * (2**20 + 10) + b'"}'), 413, "--max-request-mb")
    still_serving(server)


@pytest.mark.parametrize("where", ["top", "extra", "content", "schema"])
def test_deep_nesting_is_a_400_naming_the_limit(server, where):
    deep = {"a": None}
    for _ in range(200):
        deep = {"a": deep}
    body = {"messages": USER, "max_tokens": 4}
    if where == "top":
        raw = b"[" * 10_000 + b"]" * 10_000
    else:
        if where == "extra":
            body["metadata_x"] = deep
        elif where == "content":
            body["messages"] = [{"role": "user", "content": [deep]}]
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
        raw = None
    r = post(server, raw if raw is not None else body)
    error = refused(r, 400, f"at most {MAX_JSON_DEPTH} are allowed")
    assert error["code"] == "nesting_too_deep"
    still_serving(server)


def test_too_many_messages_nan_and_stream_options_are_400s_with_their_reason(server):
    error = refused(post(server, {"messages": USER * (MAX_MESSAGES + 1)}), 400, f"at most {MAX_MESSAGES}")
    assert error["param"] == "messages"
    refused(post(server, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": NaN}'), 400,
            "NaN is not a JSON number")
    refused(post(server, b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}'), 400,
            "Infinity is not a JSON number")
    for field in ("max_tokens", "n", "top_logprobs", "top_k"):  # 1e400 parses as infinity: a range error, not a 500
        extra = ', "logprobs": true' if field == "top_logprobs" else ""
        refused(post(server, b'{"messages": [{"role": "user", "content": "x"}], "%s": 1e400%s}'
                     % (field.encode(), extra.encode())), 400, "got inf")
    error = refused(post(server, {"messages": USER, "stream_options": {"include_usage": True}}), 400,
                    "only allowed when stream is true")
    assert error["param"] == "stream_options"
    still_serving(server)


def test_wrong_methods_get_405_with_allow_and_unknown_routes_an_openai_404(server):
    r = httpx.get(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    refused(r, 405, "GET is not allowed on /v1/chat/completions")
    r = httpx.delete(server.url + "/v1/models", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    for method in ("HEAD", "OPTIONS"):
        r = httpx.request(method, server.url + "/v1/chat/completions", timeout=10)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
    for method, path in (("GET", "/v1/nope"), ("POST", "/v1/completions"), ("GET", "/v1/chat/completions/x")):
        r = httpx.request(method, server.url + path, timeout=10)
        assert refused(r, 404, f"unknown API route {path}")["code"] == "unknown_route"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200
    still_serving(server)


@pytest.mark.parametrize("case,words", [
    ("minLength", "minLength 100000 is larger than the limit"),
    ("properties", "5000 properties; the limit is 1000"),
    ("enum", "2000 enum values; the limit is 1000"),
    ("tools", "has 129 tools; the limit is 128"),
])
def test_schemas_too_complex_for_a_grammar_are_refused_fast(server, case, words):
    """What took a core for seconds to compile into a grammar (a 100,000-character minimum length, 5,000
    required properties) is a 400 naming the limit; a schema inside the limits is served."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    if case == "minLength":
        schema["properties"]["a"]["minLength"] = 100000
    elif case == "properties":
        schema = {"type": "object", "required": [f"p{i}" for i in range(5000)],
                  "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}
    elif case == "enum":
        schema["properties"]["a"]["enum"] = [f"v{i}" for i in range(2000)]
    body = {"messages": USER, "max_tokens": 4}
    if case == "tools":
        body["tools"] = [{"type": "function", "function": {"name": f"t{i}", "parameters": schema}}
                         for i in range(129)]
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    refused(post(server, body), 400, words)
    ok = {"messages": USER, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200}}}}}}
    assert post(server, ok).status_code == 200
