"""A representative part of the bad-input sweep (``bench/bad_input_sweep.py``, tables in
``tests/support/bad_inputs.py``) against the API of the real engine on the tiny model: every fourth kind of
each group (wrong types and ranges of each field, non-finite numbers, field combinations, odd but legal
requests, bad requests asking for a stream, broken images, wrong messages and roles, malformed bodies and
limits, lone surrogates, non-JSON content types and foreign origins, wrong methods and routes) and every kind
the first full sweep found answered wrongly.  Each must get its status: never a 5xx, a 4xx with an OpenAI error
body whose message names the field or the limit, 200 for the legal ones; afterwards a normal request is still
answered."""
from __future__ import annotations

import httpx
import pytest

from qwen_chat.config import ServiceConfig
from tests.support import bad_inputs as B
from tests.support.servers import serve_engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: loads the tiny model and decodes on CPU

MAX_REQUEST_MB = 1.0
#: Kinds the first full sweep (2026-12-02) found answered wrongly, all fixed: kept in the CI part.
FOUND_BY_THE_SWEEP = {
    "logprobs: number", "stream: number", "stream_options include_usage string", "lone surrogate in a stop string",
    "max_tokens: NaN", "temperature: Infinity", "seed: -Infinity", "system message not first",
    "last message from the assistant", "blank user message", "response_format: too many properties",
}


def subset() -> list[B.Case]:
    """Every fourth kind of each group (heavy ones left out) and the kinds of ``FOUND_BY_THE_SWEEP``."""
    seen: dict[str, int] = {}
    out = []
    for case in B.cases(int(MAX_REQUEST_MB * 2**20)):
        index = seen.get(case.group, 0)
        seen[case.group] = index + 1
        if not case.heavy and (index % 4 == 0 or case.name in FOUND_BY_THE_SWEEP):
            out.append(case)
    return out


CASES = subset()


@pytest.fixture(scope="module")
def url(tiny_loaded, tmp_path_factory):
    cfg = ServiceConfig(model="tiny", history_dir=tmp_path_factory.mktemp("history"), max_batch=2, max_queue=8,
                        max_context=2048, image_token_budget=64, max_request_mb=MAX_REQUEST_MB)
    with serve_engine(tiny_loaded, cfg) as (served_url, _engine):
        yield served_url


def test_the_subset_covers_every_group_and_the_found_kinds():
    groups = {c.group for c in B.cases(2**20)}
    assert {c.group for c in CASES} == groups
    assert FOUND_BY_THE_SWEEP <= {c.name for c in CASES}
    assert len(B.cases(2**20)) >= 150


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_kind_gets_its_answer_never_a_5xx(url, case):
    answer = B.send(case, url, timeout_s=120)
    verdict, why = B.judge(case, answer)
    assert verdict == "ok", f"{case.group} / {case.name}: {verdict}: {why}"


def test_a_normal_request_is_answered_after_the_sweep(url):
    r = httpx.post(url + "/v1/chat/completions", json=B.BASE, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
