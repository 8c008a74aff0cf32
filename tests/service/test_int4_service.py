"""The real service (``start.sh``, tiny model, one CPU process) started with ``--quantize int4``: the start-up log
says which weights are 4-bit, ``/v1/models`` reports them, and a chat completion is answered through the
OpenAI-compatible API.  (On the tiny model, text hidden 64, only the projections whose input width is a multiple
of the group size 128 become 4-bit: the attention ``o_proj`` and the three Gated DeltaNet ``out_proj``.)"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.service_harness import ServiceProcess, service_argv, wait_healthy
from tests.support.servers import free_port

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny_cache(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint).parent


@pytest.mark.slow  # reason: starts the real service (tiny model); ~30-60 s on 2 CPU cores
def test_service_with_quantize_int4_answers_through_the_api(tmp_path, tiny_cache):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = service_argv(port, tmp_path / "history", tiny_cache, "--quantize", "int4", "--max-context", "1024")
    with ServiceProcess(argv, tmp_path / "service.log") as svc:
        wait_healthy(url, timeout_s=300)
        log = svc.log_text()
        assert ("weights: 4-bit (W4A16, groups of 128 input columns, --quantize int4) for 4 linear layers" in log
                and "linear_attn.out_proj x3, self_attn.o_proj x1" in log), log[-3000:]
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        weights = model["engine"]["weights"]
        assert weights["int4_modules"] == 4 and weights["int4_group_size"] == 128
        assert weights["int4_sources"] == ["--quantize int4"] and weights["fp8_modules"] == 0
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": model["id"], "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
