"""What a web page in the user's browser may do with the API (``web/api/browsers``, public case: any page can
POST to a service on 127.0.0.1): a request from another site's page is refused 403 whatever its content type,
a body not declared as JSON is refused 415 (the content types a browser sends without a CORS preflight), the
service's own origin and scripts without an ``Origin`` are served, and a page of ``--allowed-origins`` gets its
preflight answered and the CORS header on every answer, streamed ones included.  Nothing refused reaches the
backend."""
from __future__ import annotations

import httpx
import pytest

from qwen_chat.config import ConfigError, ServiceConfig
from tests.support.fake_backend import FakeBackend
from tests.web.test_api import Server

BODY = b'{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}'
ALLOWED = "https://tools.example.org"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = ServiceConfig(model="fake", history_dir=tmp_path_factory.mktemp("h"), allowed_origins=(ALLOWED,))
    backend = FakeBackend()
    with Server(backend, cfg) as srv:
        srv.backend = backend
        yield srv


def post(server, headers: dict, body: bytes = BODY, path="/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "application/json"])
def test_another_sites_page_is_refused_whatever_it_sends(server, kind):
    before = len(server.backend.calls)
    r = post(server, {"origin": "https://evil.example.com", "content-type": kind})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "--allowed-origins https://evil.example.com" in r.json()["error"]["message"]
    assert "access-control-allow-origin" not in r.headers
    models = httpx.get(server.url + "/v1/models", headers={"origin": "null"}, timeout=30)
    assert models.status_code == 403                      # a sandboxed frame or a local file: refused too
    assert len(server.backend.calls) == before            # nothing reached the engine


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_body_not_declared_as_json_is_refused_415(server, kind):
    before = len(server.backend.calls)
    r = post(server, {"content-type": kind} if kind else {})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert len(server.backend.calls) == before
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_scripts_and_the_services_own_page_are_served(server):
    host = server.url.split("://", 1)[1]
    for headers in ({"content-type": "application/json"},
                    {"content-type": "application/json; charset=utf-8", "origin": f"http://{host}"}):
        r = post(server, headers)
        assert r.status_code == 200, r.text[:200]
        assert "access-control-allow-origin" not in r.headers


def test_an_allowed_origin_gets_its_preflight_and_the_cors_header(server):
    pre = httpx.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "origin": ALLOWED, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"   # what it asked for
    r = post(server, {"origin": ALLOWED, "content-type": "application/json"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    assert "X-Dropped-Messages" in r.headers["access-control-expose-headers"]
    stream = post(server, {"origin": ALLOWED, "content-type": "application/json"},
                  body=BODY[:-1] + b', "stream": true}')
    assert stream.status_code == 200 and stream.headers["access-control-allow-origin"] == ALLOWED
    assert stream.text.rstrip().endswith("data: [DONE]")
    other = httpx.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "origin": "https://evil.example.com", "access-control-request-method": "POST"})
    assert other.status_code == 405 and "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("value", ["example.org", "ftp://example.org", "https://example.org/path",
                                   "https://user@example.org", "https://example.org:99999"])
def test_a_value_that_is_not_an_origin_stops_the_start(value, tmp_path):
    with pytest.raises(ConfigError, match="--allowed-origins"):
        ServiceConfig(model="tiny", history_dir=tmp_path, allowed_origins=(value,)).validate()
    ServiceConfig(model="tiny", history_dir=tmp_path, allowed_origins=("*", "http://localhost:3000")).validate()
