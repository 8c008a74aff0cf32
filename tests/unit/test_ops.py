"""Health and metrics (qwen_chat.web.ops): the instrumented backend wrapper, /healthz and /metrics."""
from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings, InvalidInput
from qwen_chat.web import ops
from tests.support.fake_backend import FakeBackend
from tests.support.metrics import metric_samples
from tests.support.servers import RunningServer

pytestmark = pytest.mark.timeout(60)

HELLO = [ChatMessage(role="user", text="hello")]


def samples(registry) -> dict:
    return metric_samples(generate_latest(registry).decode())


def test_counts_requests_errors_tokens_and_timings():
    fake = FakeBackend()
    backend = ops.instrument(fake)
    settings = GenerationSettings.preset(True, seed=1)
    updates = list(backend.stream_chat(HELLO, settings, CancelToken()))
    assert updates[-1].finish_reason == "stop"
    with pytest.raises(InvalidInput):
        list(backend.stream_chat(HELLO, GenerationSettings(top_p=0.0), CancelToken()))
    fake.ready = False
    with pytest.raises(Exception) as info:
        list(backend.stream_chat(HELLO, settings, CancelToken()))
    assert info.value.kind == "not_ready"

    m = samples(backend.registry)
    assert m[("qwen_chat_requests_total", ())] == 3
    assert m[("qwen_chat_errors_total", (("kind", "invalid_input"),))] == 1
    assert m[("qwen_chat_errors_total", (("kind", "not_ready"),))] == 1
    assert m[("qwen_chat_finished_total", (("finish_reason", "stop"),))] == 1
    assert m[("qwen_chat_prompt_tokens_total", ())] == 1
    assert m[("qwen_chat_completion_tokens_total", ())] == updates[-1].completion_tokens
    assert m[("qwen_chat_ttft_seconds_count", ())] == 1
    assert m[("qwen_chat_decode_tokens_per_second_count", ())] == 1
    assert m[("qwen_chat_active_streams", ())] == 0
    assert m[("qwen_chat_healthy", ())] == 0  # fake.ready is False now


def test_active_streams_and_close_cancels_inner():
    fake = FakeBackend(answer_words=100)
    backend = ops.instrument(fake)
    stream = backend.stream_chat(HELLO, GenerationSettings.preset(False), CancelToken())
    next(stream)
    next(stream)
    assert samples(backend.registry)[("qwen_chat_active_streams", ())] == 1
    assert samples(backend.registry)[("qwen_chat_running_sequences", ())] == 1
    stream.close()
    assert fake.active == 0 and fake.calls[-1].closed
    m = samples(backend.registry)
    assert m[("qwen_chat_active_streams", ())] == 0
    assert m[("qwen_chat_finished_total", (("finish_reason", "cancelled"),))] == 1


def test_wrapper_forwards_other_attributes_and_is_idempotent():
    fake = FakeBackend()
    backend = ops.instrument(fake)
    assert backend.info.name == "fake-qwen"
    assert backend.stats()["gpu_memory_bytes"] == [1000, 2000]
    assert ops.instrument(backend) is backend
    # two apps in one process: separate registries, no "Duplicated timeseries" error
    other = ops.instrument(FakeBackend())
    assert other.registry is not backend.registry


def test_gpu_memory_per_rank_from_a_dict_and_other_stats():
    class Stats(FakeBackend):
        def stats(self):
            return {"queue_depth": 3, "gpu_memory_bytes": {0: 5.0e9, 1: 4.5e9}, "free slots": 2, "mode": "tp",
                    "decode_steps_total": 17}

    m = samples(ops.instrument(Stats()).registry)
    assert m[("qwen_chat_queue_depth", ())] == 3
    assert m[("qwen_chat_gpu_memory_bytes", (("rank", "0"),))] == 5.0e9
    assert m[("qwen_chat_gpu_memory_bytes", (("rank", "1"),))] == 4.5e9
    assert m[("qwen_chat_engine_free_slots", ())] == 2
    assert m[("qwen_chat_engine_decode_steps_total", ())] == 17
    assert not any(name.endswith("mode") for name, _ in m)  # non-numeric stats are skipped


class Health:
    def __init__(self, report):
        self.report = report

    def health(self):
        if isinstance(self.report, Exception):
            raise self.report
        return self.report


@pytest.mark.parametrize("report, status, body", [
    ({"ok": True, "reason": ""}, 200, {"status": "ok"}),
    ({"ok": True, "ranks_alive": [0, 1]}, 200, {"status": "ok", "ranks_alive": [0, 1]}),
    ({"ok": False, "reason": "rank 1 is gone"}, 503, {"status": "unavailable", "reason": "rank 1 is gone"}),
    ({"ok": False}, 503, {"status": "unavailable", "reason": "engine not ready"}),
    (RuntimeError("boom"), 503, {"status": "unavailable", "reason": "health check failed: RuntimeError"}),
])
def test_health_response(report, status, body):
    resp = ops.health_response(Health(report))
    assert resp.status_code == status
    assert json.loads(resp.body) == body


def test_routes_over_http_for_a_plain_backend():
    fake = FakeBackend(ready=False)
    app = FastAPI()
    app.include_router(ops.create_router(fake))  # not instrumented: only scrape-time gauges
    with RunningServer(app) as server:
        url = server.url
        resp = httpx.get(url + "/healthz")
        assert resp.status_code == 503 and resp.json()["reason"] == "loading model"
        fake.ready = True
        assert httpx.get(url + "/healthz").status_code == 200
        metrics = httpx.get(url + "/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        names = {f.name for f in text_string_to_metric_families(metrics.text)}
        assert {"qwen_chat_healthy", "qwen_chat_queue_depth", "qwen_chat_gpu_memory_bytes"} <= names
