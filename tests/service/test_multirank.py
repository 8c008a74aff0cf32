"""Two CPU ranks (gloo) with the tiny model under the DeepSpeed launcher, against one plain process.

Each launch runs ``tests/support/multirank_driver.py`` (every rank calls ``bootstrap.start_engine``; rank 0 runs a
scripted scenario) or the real ``start.sh`` + ``app.py``.  Launches are module-scoped fixtures shared by the
tests that read their results; every wait polls with a deadline, every process is killed at teardown.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.support.servers import free_port
from tests.support.service_harness import rank_pids, running
from tests.support.waiting import log_tail, wait_until

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "multirank_driver.py"
IMAGE = ROOT / "tests" / "fixtures" / "images" / "chelsea.png"
LAUNCH_TIMEOUT_S = 420

# Each launch starts 2 DeepSpeed ranks with the tiny model: 1-3 min each on 2 CPU cores (the shared launches
# are charged to the first test that uses them, hence the longer per-test timeout).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The DeepSpeed launcher of this interpreter (same as the `deepspeed` script start.sh runs).
LAUNCHER = [sys.executable, "-m", "deepspeed.launcher.runner"]

TEXT = "Tell me about rockets."
IMAGE_TEXT = "What is in this picture?"


def env_for(tmp: Path) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()))
    env.pop("QWEN_CHAT_DS_CONFIG", None)
    return env


def service_args(cache: Path, *extra: str) -> list[str]:
    return ["--model", "tiny", "--cache-dir", str(cache), "--device", "cpu", "--max-batch", "2",
            "--max-context", "512", *extra]


def run_driver(tmp: Path, name: str, steps: list, args: list[str], ranks: int, hold: bool = False):
    """Start the driver (under the DeepSpeed launcher when ranks > 1); returns (Popen, out path, log path)."""
    scenario, out, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    scenario.write_text(json.dumps(steps + ([{"op": "hold"}] if hold else [])))
    env = env_for(tmp)
    own = [str(DRIVER), "--scenario", str(scenario), "--out", str(out)]
    if ranks > 1:
        cmd = [*LAUNCHER, "--num_gpus", str(ranks), "--master_port", env["MASTER_PORT"], *own, "--", *args]
    else:
        cmd = [sys.executable, *own, "--", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, out, log


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multirank")
    cache = tmp / "cache"
    # Build the tiny checkpoint once, so that the launches below only load it.
    subprocess.run([sys.executable, "-m", "qwen_chat.engine.checkpoints.tiny", str(cache)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    bad = tmp / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"this is not image data" * 10)
    return tmp, cache, bad


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"]}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                            "required": ["zone"]}}
GREEDY = [
    {"op": "greedy", "name": "text", "text": TEXT, "max_new_tokens": 24},
    {"op": "greedy", "name": "image", "text": IMAGE_TEXT, "images": [str(IMAGE)], "max_new_tokens": 24},
    {"op": "structured", "name": "json", "text": TEXT, "schema": SCHEMA, "max_new_tokens": 60},
    {"op": "structured", "name": "tool", "text": TEXT, "tools": [CLOCK], "tool_choice": "required",
     "max_new_tokens": 60},
]


@pytest.fixture(scope="module")
def reference(work):
    """Greedy tokens of one plain process (no launcher, no DeepSpeed)."""
    tmp, cache, _ = work
    proc, out, log = run_driver(tmp, "ref", GREEDY, service_args(cache), ranks=1)
    try:
        assert proc.wait(LAUNCH_TIMEOUT_S) == 0, log_tail(log)
    finally:
        kill_group(proc)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp_run(work):
    """TP=2 over 2 CPU ranks with a 2 s collective timeout: greedy, Stop, bad requests, idle, greedy again."""
    tmp, cache, bad = work
    steps = GREEDY + [
        {"op": "stop", "name": "stop", "text": TEXT, "after": 3},
        {"op": "expect_error", "name": "bad_image", "text": IMAGE_TEXT, "images": [str(bad)]},
        {"op": "expect_error", "name": "too_long", "text": "rocket " * 2000},
        {"op": "greedy", "name": "text_after_errors", "text": TEXT, "max_new_tokens": 24},
        {"op": "idle", "seconds": 6},
        {"op": "greedy", "name": "image_after_idle", "text": IMAGE_TEXT, "images": [str(IMAGE)],
         "max_new_tokens": 24},
    ]
    args = service_args(cache, "--ds-config", str(ROOT / "ds_config.json"), "--collective-timeout-s", "2")
    proc, out, log = run_driver(tmp, "tp", steps, args, ranks=2)
    try:
        code = proc.wait(LAUNCH_TIMEOUT_S)
    finally:
        kill_group(proc)
    assert code == 0, log_tail(log)
    return json.loads(out.read_text()), log.read_text(errors="replace")


def test_tp2_matches_single_process_greedy(reference, tp_run):
    result, _ = tp_run
    assert result["info"] == {"world_size": 2, "mode": "tp"}
    assert result["health"]["ok"], result["health"]
    for name in ("text", "image"):
        assert len(reference["steps"][name]["tokens"]) == 24
        assert result["steps"][name]["tokens"] == reference["steps"][name]["tokens"], name


def test_tp2_structured_output_matches_single_process(reference, tp_run):
    """Grammar masks apply on rank 0 only; every rank records rank 0's tokens, so the group stays in step and
    the constrained replies equal the single process's."""
    import jsonschema

    result, _ = tp_run
    for name in ("json", "tool"):
        assert result["steps"][name] == reference["steps"][name], name
    jsonschema.validate(json.loads(result["steps"]["json"]["answer"]), SCHEMA)
    (call_name, arguments), = result["steps"]["tool"]["tool_calls"]
    assert call_name == "get_time" and result["steps"]["tool"]["finish"] == "tool_calls"
    jsonschema.validate(json.loads(arguments), CLOCK["parameters"])


def test_tp2_start_up_report(tp_run):
    _, log = tp_run
    assert re.search(r"rank 0/2: device cpu, parameters held [\d.]+ M", log)
    assert re.search(r"rank 1/2: device cpu, parameters held [\d.]+ M", log)
    assert "sharding: tp (autotp_size=2, world 2" in log
    # the tiny model's 3 Gated DeltaNet layers (16 key / 32 value heads) split by heads, not gathered
    assert "TP: 3 Gated DeltaNet layers split by heads over 2 ranks (8 key / 16 value heads each)" in log
    assert "kernel: recurrent delta rule (decode) ->" in log
    assert "self-check passed on 2 rank(s)" in log
    # decode under TP: every projection group fused (the tiny model's 4 layers x mixer + MLP, DeepSpeed's
    # column-parallel q/k/v and gate/up too), the all-reduces through the runner's comm, steps launched ahead
    impl = re.search(r"runner implementation: (\{.*\})", log)
    assert impl, log[-3000:]
    assert "'fused_projection_groups': 8" in impl.group(1)
    assert "'tp_all_reduce': 'torch.distributed'" in impl.group(1)
    assert "scheduler: steps launched ahead (overlap)" in log
    # DeepSpeed's CPU all-reduce buffers (/dev/shm, 66 MB per rank) do not outlive the run
    port = re.search(r"--master_port=(\d+)", log).group(1)
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: unlinked DeepSpeed's shared-memory all-reduce file \S+_{port}_{rank}", log)
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []


def test_stop_on_rank0_ends_generation_on_both_ranks(reference, tp_run):
    result, log = tp_run
    stop = result["steps"]["stop"]
    assert stop["finish"] == "cancelled"
    assert 0 < stop["completion_tokens"] < 64
    # Both ranks ran exactly the same number of engine steps: the worker did not keep generating.
    sent = re.search(r"rank 0: exit sent to 1 worker rank\(s\) after (\d+) steps", log)
    got = re.search(r"rank 1: exit message after (\d+) steps; leaving cleanly", log)
    assert sent and got, log[-3000:]
    assert sent.group(1) == got.group(1)
    # and the next requests on the freed slots are still exact
    assert result["steps"]["text_after_errors"]["tokens"] == reference["steps"]["text"]["tokens"]


def test_bad_requests_are_rejected_on_rank0_and_the_next_succeeds(reference, tp_run):
    result, _ = tp_run
    assert result["steps"]["bad_image"]["error"] == "InvalidImage"
    assert result["steps"]["too_long"]["error"] == "ContextTooLong"
    assert result["steps"]["text_after_errors"]["tokens"] == reference["steps"]["text"]["tokens"]


def test_workers_survive_idle_longer_than_collective_timeout(reference, tp_run):
    result, log = tp_run
    assert result["steps"]["image_after_idle"]["tokens"] == reference["steps"]["image"]["tokens"]
    assert "lost rank 0" not in log


def test_zero3_matches_single_process_and_a_killed_rank_ends_the_group(work, reference):
    tmp, cache, _ = work
    args = service_args(cache, "--ds-config", str(ROOT / "deploy" / "ds_config.zero3.json"))
    steps = [dict(s, max_new_tokens=12) for s in GREEDY]
    proc, out, log = run_driver(tmp, "zero3", steps, args, ranks=2, hold=True)
    try:
        wait_until(out.exists, LAUNCH_TIMEOUT_S, "the ZeRO-3 results", poll_s=0.5, process=proc, log=log)
        result = json.loads(out.read_text())
        assert result["info"] == {"world_size": 2, "mode": "zero3"}
        for name in ("text", "image"):
            assert result["steps"][name]["tokens"] == reference["steps"][name]["tokens"][:12], name
        assert "sharding: zero3 (stage 3" in log.read_text()

        pids = rank_pids(proc.pid)
        assert set(pids) == {0, 1}
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(60)
        elapsed = time.monotonic() - t0
        assert code != 0
        assert elapsed < 30, f"group took {elapsed:.1f} s to exit"
        assert not running(pids[0])
    finally:
        kill_group(proc)


def listening_pids(port: int) -> set[int]:
    return {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def test_start_sh_only_rank0_listens_and_sigterm_stops_all_ranks(work):
    tmp, cache, _ = work
    if not (ROOT / "app.py").exists():
        pytest.skip("app.py not present")
    port = free_port()
    env = env_for(tmp)
    env["NUM_CPU_RANKS"] = "2"
    log = tmp / "app.log"
    proc = subprocess.Popen(
        ["bash", str(ROOT / "start.sh"), "--model", "tiny", "--cache-dir", str(cache), "--port", str(port),
         "--max-batch", "2", "--max-context", "512", "--history-dir", str(tmp / "history")],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def healthy():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, LAUNCH_TIMEOUT_S, "/healthz", poll_s=0.5, process=proc, log=log)
        pids = rank_pids(proc.pid)
        assert set(pids) == {0, 1}
        assert listening_pids(port) == {pids[0]}
        # Supervisor stops the program group with SIGTERM (deploy/qwen3.5-9b.conf: stopasgroup=true).
        os.killpg(proc.pid, signal.SIGTERM)
        wait_until(lambda: not any(running(p) for p in pids.values()), 60, "all ranks to exit", poll_s=0.5, log=log)
        text = log.read_text(errors="replace")
        assert re.search(r"rank 0: exit sent to 1 worker rank\(s\)", text), log_tail(log)
        assert "rank 1: exit message after" in text and "rank 1: worker stopped cleanly" in text, log_tail(log)
    finally:
        kill_group(proc)


def test_zero3_in_one_process_without_launcher(work, reference):
    """World size 1 with a DeepSpeed config (e.g. one small GPU with ZeRO-3 offload) takes the same path."""
    tmp, cache, _ = work
    args = service_args(cache, "--ds-config", str(ROOT / "deploy" / "ds_config.zero3.json"))
    proc, out, log = run_driver(tmp, "zero3_single", [dict(GREEDY[0], max_new_tokens=12)], args, ranks=1)
    try:
        assert proc.wait(LAUNCH_TIMEOUT_S) == 0, log_tail(log)
    finally:
        kill_group(proc)
    result = json.loads(out.read_text())
    assert result["info"] == {"world_size": 1, "mode": "zero3"}
    assert result["steps"]["text"]["tokens"] == reference["steps"]["text"]["tokens"][:12]
