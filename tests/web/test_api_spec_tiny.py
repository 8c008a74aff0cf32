"""Speculative decoding through the OpenAI-compatible API on the tiny model (CPU): the service built from its
configuration (``--speculative-tokens 2``: the checkpoint's MTP head loaded, its KV cache in the memory plan)
answers greedy requests exactly as the service without it, counts drafted and accepted tokens on ``/metrics``,
and a client that hangs up mid-stream frees its slot."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from qwen_chat.config import ServiceConfig
from tests.support.metrics import scrape
from tests.support.servers import hang_up_after, serve_engine
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: builds two engines and decodes on CPU

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def ask(url: str, i: int) -> tuple[str, str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=240)
    r = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=48, extra_body=NO_THINK,
        messages=[{"role": "user", "content": f"Question {i}: tell me about the number {i * 37}."}])
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def test_speculating_service_answers_like_the_plain_one_and_counts_on_metrics(tiny_loaded, tmp_path):
    replies = {}
    for k in (0, 2):
        cfg = ServiceConfig(model="tiny", history_dir=tmp_path / f"h{k}", max_batch=4, max_queue=16,
                            max_context=512, image_token_budget=64, speculative_tokens=k)
        with serve_engine(tiny_loaded, cfg) as (url, engine):
            with ThreadPoolExecutor(4) as pool:
                replies[k] = list(pool.map(lambda i: ask(url, i), range(4)))
            metrics = scrape(url)
            if k:
                assert engine.runner.spec is not None and len(engine.runner.k_cache) == 2  # + the MTP layer's
                assert metrics[("qwen_chat_engine_spec_steps_total", ())] > 0
                drafted = metrics[("qwen_chat_engine_spec_drafted_total", ())]
                assert drafted > 0 and metrics[("qwen_chat_engine_spec_accepted_total", ())] <= drafted
                assert 0 <= metrics[("qwen_chat_engine_spec_acceptance_rate", ())] <= 1
                client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=240)
                stream = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Write a long story."}], temperature=0,
                    max_tokens=4096, stream=True, extra_body=NO_THINK)
                hang_up_after(stream, 3)
                assert wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["queue_depth"] == 0)
                assert engine.stats()["finished_cancelled_total"] >= 1
            else:
                assert metrics[("qwen_chat_engine_spec_steps_total", ())] == 0
    assert replies[2] == replies[0]
