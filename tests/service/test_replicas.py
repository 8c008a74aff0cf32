"""Two data-parallel replicas of the tiny model behind one port, through ``start.sh`` as an operator runs them:
``NUM_CPU_RANKS=2 bash start.sh --model tiny --data-parallel 2`` (2 replicas x 1 rank) and, with 4 CPU ranks,
2 replicas x 2 ranks (tensor parallel inside each replica).

One service per layout, shared by the tests of that layout in file order (API and web page alike); the last
test kills a rank of replica 1 with SIGKILL, which must end the whole group.  Which replica served a request is read from
``/metrics`` (the ``replica`` label), as an operator would.  A bad layout (3 ranks, TP 2) is refused at start.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from gradio_client import Client

from tests.support.metrics import scrape
from tests.support.servers import free_port
from tests.support.service_harness import (
    REPO,
    ServiceProcess,
    group_pids,
    health,
    rank_pids,
    service_argv,
    ui_submit,
)
from tests.support.waiting import log_tail, wait_until

# slow: each layout starts 2 or 4 CPU ranks with the tiny model (about 30 s / 90 s on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

START_TIMEOUT_S = 420
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
LAYOUTS = [pytest.param(2, id="2x1"), pytest.param(4, id="2x2")]


@dataclass
class Service:
    url: str
    ranks: int
    process: ServiceProcess
    log: Path


def cpu_env(ranks: int) -> dict:
    return {"NUM_CPU_RANKS": str(ranks), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "QWEN_CHAT_DS_CONFIG": ""}


@pytest.fixture(scope="module", params=LAYOUTS)
def service(request, tiny_checkpoint, tmp_path_factory):
    ranks = request.param
    tmp = tmp_path_factory.mktemp(f"replicas{ranks}")
    port = free_port()
    argv = service_argv(port, tmp / "history", tiny_checkpoint.parent, "--data-parallel", "2", "--max-batch", "4",
                        "--max-context", "512")
    log = tmp / "service.log"
    with ServiceProcess(argv, log, env=cpu_env(ranks)) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: health(url)[0] == 200, START_TIMEOUT_S, "/healthz 200", poll_s=0.5, process=proc.proc,
                   log=log)
        yield Service(url, ranks, proc, log)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def stream_text(url: str, prompt: str, max_tokens: int = 16) -> str:
    """The whole answer of one streamed greedy request."""
    stream = client(url).chat.completions.create(model="tiny", temperature=0, max_tokens=max_tokens, stream=True,
                                                 extra_body=NO_THINK, messages=[{"role": "user", "content": prompt}])
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def open_stream(url: str, prompt: str):
    """A long greedy stream, its first answer chunk read (so it is running on its replica)."""
    stream = client(url).chat.completions.create(model="tiny", temperature=0, max_tokens=450, stream=True,
                                                 extra_body=NO_THINK, messages=[{"role": "user", "content": prompt}])
    next(c for c in stream if c.choices and c.choices[0].delta.content)
    return stream


#: Seconds between the two reads of ``settled``: more than two of the engines' status periods (0.25 s).
STATUS_SETTLE_S = 0.6


def per_replica(url: str, name: str) -> list[float]:
    """A replica-labelled series of ``/metrics`` for replicas 0 and 1."""
    metrics = scrape(url)
    return [metrics.get((name, (("replica", r),)), 0.0) for r in ("0", "1")]


def settled(url: str, name: str) -> list[float]:
    """``per_replica`` once two reads ``STATUS_SETTLE_S`` apart agree: every engine's counters reach the front
    in its status, sent every 0.25 s, so a read right after a short request may not count it yet (two reads
    moments apart would agree on the stale value)."""
    deadline = time.monotonic() + 10
    last = per_replica(url, name)
    while True:
        time.sleep(STATUS_SETTLE_S)
        now = per_replica(url, name)
        if now == last:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not settle: {last} then {now}")
        last = now


def delta(before: list[float], after: list[float]) -> list[float]:
    return [b - a for a, b in zip(before, after)]


def test_healthz_reports_both_replicas_and_the_log_their_layout(service):
    status, body = health(service.url)
    assert status == 200 and body["data_parallel"] == 2 and body["world_size"] == service.ranks
    half = service.ranks // 2
    assert [(r["replica"], r["ranks"], r["ok"]) for r in body["replicas"]] == [
        (0, list(range(half)), True), (1, list(range(half, 2 * half)), True)]
    log = service.process.log_text()
    assert f"data parallel: 2 replicas x {half} rank(s) each (world {service.ranks})" in log
    ranks = ", ".join(str(r) for r in range(half, 2 * half))
    assert f"replica 1: rank{'s' if half > 1 else ''} {ranks} (" in log
    assert "data parallel: all 2 replicas ready behind the web front" in log
    mode = "tp" if half > 1 else "single"
    assert f"sharding: {mode} (" in log


def test_sixteen_concurrent_requests_spread_over_both_replicas_and_equal_their_solo_runs(service):
    prompts = [f"Request {i}: say something about the number {i * 13}." for i in range(16)]
    solo = [stream_text(service.url, p) for p in prompts]
    assert all(solo)
    before = settled(service.url, "qwen_chat_engine_requests_total")
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: stream_text(service.url, p), prompts))
    assert together == solo
    served = delta(before, settled(service.url, "qwen_chat_engine_requests_total"))
    assert sum(served) == 16 and min(served) >= 4, served  # both replicas took a share of the burst


def test_disconnect_ends_the_stream_on_its_own_replica(service):
    cancelled = per_replica(service.url, "qwen_chat_engine_finished_cancelled_total")
    first = open_stream(service.url, "Tell me a very long story about rockets.")
    wait_until(lambda: sum(per_replica(service.url, "qwen_chat_running_sequences")) == 1, 30, "one stream")
    a = per_replica(service.url, "qwen_chat_running_sequences").index(1)
    second = open_stream(service.url, "Tell me a very long story about boats.")
    wait_until(lambda: per_replica(service.url, "qwen_chat_running_sequences") == [1, 1], 30,
               "the second stream on the other replica")
    second.close()  # the client hangs up: Stop for the API
    b = 1 - a
    wait_until(lambda: per_replica(service.url, "qwen_chat_running_sequences")[b] == 0, 30, "replica b idle")
    assert delta(cancelled, per_replica(service.url, "qwen_chat_engine_finished_cancelled_total"))[b] == 1
    assert per_replica(service.url, "qwen_chat_running_sequences")[a] == 1  # the other replica's stream goes on
    first.close()
    wait_until(lambda: delta(cancelled, per_replica(service.url, "qwen_chat_engine_finished_cancelled_total"))
               == [1, 1], 30, "both streams cancelled, each on its replica")


def test_a_conversations_second_turn_lands_on_the_replica_of_its_first(service):
    hold = open_stream(service.url, "Keep one replica busy with a long story.")
    routed = per_replica(service.url, "qwen_chat_engine_routed_total")
    question = "What is a rocket?"
    answer = stream_text(service.url, question)
    first = delta(routed, per_replica(service.url, "qwen_chat_engine_routed_total"))
    assert sorted(first) == [0, 1]
    home = first.index(1)  # the replica that was not busy
    hold.close()
    wait_until(lambda: sum(per_replica(service.url, "qwen_chat_running_sequences")) == 0, 30, "both idle")
    affinity = per_replica(service.url, "qwen_chat_engine_routed_affinity_total")
    r = client(service.url).chat.completions.create(
        model="tiny", temperature=0, max_tokens=8, extra_body=NO_THINK,
        messages=[{"role": "user", "content": question}, {"role": "assistant", "content": answer},
                  {"role": "user", "content": "And a boat?"}])
    assert r.choices[0].finish_reason in ("length", "stop")
    assert delta(affinity, per_replica(service.url, "qwen_chat_engine_routed_affinity_total"))[home] == 1


def test_the_pages_conversation_stays_on_its_replica(service):
    """The same rule for the web page: its second turn (history saved by the page) goes where the first went."""
    page = Client(service.url + "/", verbose=False)
    hold = open_stream(service.url, "Keep one replica busy with a long story.")
    routed = per_replica(service.url, "qwen_chat_engine_routed_total")
    conv_id = ui_submit(page, "Hello from the page.", max_new_tokens=64).result(timeout=120)[1]
    home = delta(routed, per_replica(service.url, "qwen_chat_engine_routed_total")).index(1)
    hold.close()
    wait_until(lambda: sum(per_replica(service.url, "qwen_chat_running_sequences")) == 0, 30, "both idle")
    affinity = per_replica(service.url, "qwen_chat_engine_routed_affinity_total")
    ui_submit(page, "And then?", conv_id=conv_id, max_new_tokens=64).result(timeout=120)
    assert delta(affinity, per_replica(service.url, "qwen_chat_engine_routed_affinity_total"))[home] == 1


def test_kill_9_of_a_rank_in_one_replica_ends_the_whole_group(service):
    launcher = service.process.proc
    pids = rank_pids(launcher.pid)
    assert sorted(pids) == list(range(service.ranks))
    victim = pids[service.ranks - 1]  # replica 1's last rank: its lead at 2 x 1, a worker rank at 2 x 2
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    code = launcher.wait(60)
    elapsed = time.monotonic() - t0
    assert code != 0, log_tail(service.log)
    assert elapsed < 30, f"the group took {elapsed:.1f} s to exit"
    wait_until(lambda: not group_pids(launcher.pid), 10, "no process of the old group left")


def test_a_world_that_does_not_split_into_replicas_fails_at_start_with_one_line(tmp_path, tiny_checkpoint):
    config = tmp_path / "tp2.json"
    config.write_text(json.dumps({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 0}}))
    argv = service_argv(free_port(), tmp_path / "history", tiny_checkpoint.parent, "--data-parallel", "2",
                        "--ds-config", str(config))
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **cpu_env(3)})
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "app.py: configuration error" in line]
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert lines == ["app.py: configuration error: the launcher started 3 rank(s), not a multiple of the "
                     f"tensor-parallel degree 2 (tensor_parallel.autotp_size in {config})"]
