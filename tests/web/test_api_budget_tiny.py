"""Many concurrent API requests on the tiny model under a memory budget too small for all of them at once: every
request is answered, each stream equals its solo run at temperature 0 (no stream gets another's tokens), and
the KV blocks that ran out were recovered by preempting and recomputing sequences, as ``/metrics`` and
``/v1/models`` report."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from qwen_chat.config import ServiceConfig
from tests.support.metrics import scrape
from tests.support.servers import serve_engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: loads the tiny model and decodes on CPU

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
#: 4 state slots and about 384 tokens of KV cache for the tiny model (0.14 MiB per slot, 2 KiB of KV per token
#: plus what the budget keeps per token of context for the decode attention's scores): 4 sequences of ~150
#: tokens need more blocks than there are.
BUDGET_GIB = 2.3 / 1024


@pytest.fixture(scope="module")
def served(tiny_loaded, tmp_path_factory):
    cfg = ServiceConfig(model="tiny", history_dir=tmp_path_factory.mktemp("history"), max_batch=4, max_queue=16,
                        max_context=384, memory_budget_gib=BUDGET_GIB, image_token_budget=64)
    with serve_engine(tiny_loaded, cfg) as served:
        yield served


def ask(url: str, i: int) -> tuple[str, str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=240)
    r = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=120, extra_body=NO_THINK,
        messages=[{"role": "user", "content": f"Question {i}: tell me about the number {i * 37}."}])
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def test_concurrent_streams_under_a_small_budget_equal_their_solo_runs(served):
    url, _ = served
    card = httpx.get(url + "/v1/models").json()["data"][0]
    engine = card["engine"]
    assert engine["state_slots"] == engine["max_concurrent_sequences"] == 4
    assert engine["kv_tokens"] == engine["kv_blocks"] * engine["kv_block_tokens"] >= card["max_model_len"] == 384
    solo = [ask(url, i) for i in range(8)]
    assert sum(n for _, _, n in solo) > 4 * 120 // 2  # long enough replies that 4 at once overflow the blocks
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: ask(url, i), range(8)))
    assert together == solo
    metrics = scrape(url)
    assert metrics[("qwen_chat_engine_preemptions_total", ())] > 0
    assert metrics[("qwen_chat_engine_kv_blocks", ())] == engine["kv_blocks"]
