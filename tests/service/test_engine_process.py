"""The service's two processes (engine, web front) on the tiny model, from outside, as an operator meets them:

* ``kill -9`` of the engine process: the front answers 503 and exits non-zero within 5 s; ``kill -9`` of the
  front: the engine process exits within 5 s; either way no process of the group is left (the front's prompt
  workers included), also with 2 CPU ranks and with 2 data-parallel replicas;
* the engine process frozen (SIGSTOP: a health check must not say 200 for a frozen engine): ``/healthz`` 503 within ``wire.ENGINE_SILENT_S`` and a
  few seconds, the open stream ends with an error, and the whole group is gone;
* a 16 MB message while 8 streams run: the streams keep receiving tokens (the message is tokenized in a
  prompt worker, not in the engine process nor in the front's event loop) and the big request gets its
  context error; a body over ``--max-request-mb`` gets 413 naming the limit, before it is read.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.service_harness import ServiceProcess, group_pids, health, service_argv, wait_healthy
from tests.support.servers import free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # reason: starts the real service several times

#: Seconds within which the surviving process must be gone (the issue's bound).
EXIT_LIMIT_S = 5.0
#: Longest gap between two chunks of a running stream while the big request is handled: a generous CPU bound
#: (2 shared cores; on a GPU the benchmark records the real figure, bench/serve_bench.py "noisy_neighbour").
GAP_LIMIT_S = 3.0


@pytest.fixture(scope="module")
def tiny_cache(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint).parent


def processes(launcher: int) -> tuple[list[int], int]:
    """(engine process pids: the app.py ranks, the front's pid) below the launcher."""
    engines, front = [], None
    for child in [psutil.Process(launcher), *psutil.Process(launcher).children(recursive=True)]:
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "qwen_chat.front_process" in line:
            front = child.pid
        elif "app.py" in line and "deepspeed" not in line.split("app.py")[0].split("/")[-1]:
            engines.append(child.pid)
    return engines, front


def gone_within(pids: list[int], seconds: float) -> float:
    start = time.monotonic()
    wait_until(lambda: not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"],
               seconds + 5, f"processes {pids} to exit", poll_s=0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("ranks,replicas", [(1, 1), (2, 1), (2, 2)], ids=["1-rank", "2-cpu-ranks", "2-replicas"])
def test_kill_9_of_either_process_ends_the_other(tmp_path, tiny_cache, ranks, replicas):
    env = {"NUM_CPU_RANKS": str(ranks), "DATA_PARALLEL": str(replicas)} if ranks > 1 else None
    for victim in ("engine", "front"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with ServiceProcess(service_argv(port, tmp_path / "h", tiny_cache), tmp_path / f"{victim}.log", env) as svc:
            wait_healthy(url, timeout_s=240)
            engines, front = processes(svc.proc.pid)
            assert front is not None and len(engines) == ranks, (engines, front)
            wait_until(lambda: len(psutil.Process(front).children()) >= 1, 60, "the prompt workers")
            rank0 = min(engines, key=lambda p: psutil.Process(p).create_time())
            if victim == "engine":
                os.kill(rank0, signal.SIGKILL)
                status = wait_until(lambda: health(url, 1.0)[0] in (503, None) and (health(url, 1.0)[0] or 503), 5,
                                    "the front to notice")
                assert status == 503 or not psutil.pid_exists(front)
                took = gone_within([front], EXIT_LIMIT_S)
                code = svc.proc.wait(30) if ranks == 1 else None
            else:
                os.kill(front, signal.SIGKILL)
                took = gone_within([rank0], EXIT_LIMIT_S)
                code = None
            print(f"\n[drill] {ranks} rank(s): kill -9 of the {victim}: the other process gone after {took:.1f} s")
            assert took <= EXIT_LIMIT_S
            wait_until(lambda: group_pids(svc.proc.pid) == [], 30, "no process of the group left")
            assert svc.proc.wait(30) != 0 and (code is None or code != 0)
            assert "front:" in svc.log_text() or victim == "front"


def test_a_frozen_engine_process_turns_healthz_503_and_the_group_ends(tmp_path, tiny_cache):
    """The engine process stopped (SIGSTOP: every thread frozen) while a stream runs.  Within
    ``ENGINE_SILENT_S`` + a few seconds ``/healthz`` answers 503 (or the port is closed), the stream ends with
    an error, and the whole group is gone (the front kills the frozen process: Supervisor restarts a group only
    once its main process has exited)."""
    from qwen_chat.engine.wire import ENGINE_SILENT_S

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with ServiceProcess(service_argv(port, tmp_path / "h", tiny_cache), tmp_path / "frozen.log") as svc:
        wait_healthy(url, timeout_s=240)
        engines, front = processes(svc.proc.pid)
        ended = threading.Event()
        chunks: list = []

        def read_stream() -> None:
            body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 2000,
                    "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        chunks.append(line)
            except httpx.HTTPError as exc:
                chunks.append(f"error: {exc!r}")
            ended.set()

        threading.Thread(target=read_stream, daemon=True).start()
        wait_until(lambda: len(chunks) > 3 or ended.is_set(), 60, "the stream to run")
        assert not ended.is_set(), chunks
        os.kill(engines[0], signal.SIGSTOP)
        try:
            start = time.monotonic()
            wait_until(lambda: health(url, 1.0)[0] in (503, None), ENGINE_SILENT_S + 15, "/healthz 503")
            took = time.monotonic() - start
            print(f"\n[drill] SIGSTOP of the engine process: /healthz 503 after {took:.1f} s")
            assert ended.wait(30)
            assert any("error" in c for c in chunks[-4:]), chunks[-4:]   # an error event, not a silent cut
            wait_until(lambda: group_pids(svc.proc.pid) == [], 30, "no process of the group left")
            assert svc.proc.wait(30) != 0
            assert "ending the silent engine process" in svc.log_text()
        finally:
            for pid in engines:
                if psutil.pid_exists(pid):
                    os.kill(pid, signal.SIGCONT)


def stream_gaps(url: str, prompt: str, out: list, stop: threading.Event) -> None:
    """Stream one reply, recording the arrival times of its chunks into ``out``."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 400, "temperature": 0, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
            if stop.is_set():
                break
    out.append(times)


def test_a_16_mb_message_does_not_stall_the_running_streams(tmp_path, tiny_cache):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with ServiceProcess(service_argv(port, tmp_path / "h", tiny_cache, "--max-request-mb", "20"),
                        tmp_path / "service.log"):
        wait_healthy(url, timeout_s=240)
        big = "word " * (16 * 2**20 // 5)
        # the prompt workers have loaded their processor once a small request went through
        httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        results: list = []
        stop = threading.Event()
        streams = [threading.Thread(target=stream_gaps, args=(url, f"story {i}", results, stop)) for i in range(8)]
        for t in streams:
            t.start()
        time.sleep(3.0)  # all 8 are streaming
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", timeout=300,
                       json={"messages": [{"role": "user", "content": big}], "max_tokens": 16})
        t1 = time.monotonic()
        stop.set()
        for t in streams:
            t.join(120)
        assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text[:300]
        window = [b - a for times in results for a, b in zip(times, times[1:]) if b > t0 and a < t1]
        print(f"\n[drill] 16 MB message answered {r.status_code} after {t1 - t0:.1f} s; the 8 streams' longest gap "
              f"meanwhile {max(window) * 1000:.0f} ms over {len(window)} chunk gaps")
        assert len(results) == 8 and window and max(window) < GAP_LIMIT_S

        # a body over the limit: answered from its Content-Length alone, before any of it is sent
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (21 * 2**20))
            answer = b""
            while b"}}" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 413") and "20.0 MB" in answer, answer[:500]


def test_corrupt_weights_refuse_to_start_in_one_line(tmp_path, tiny_checkpoint):
    """Every weight byte of the checkpoint overwritten (headers intact, same sizes): the start-up self-check
    sees non-finite logits and the service exits 78 with one line naming the likely cause, instead of starting
    and answering "!!!!"."""
    import shutil
    import struct
    import subprocess
    import sys

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    for shard in broken.glob("*.safetensors"):
        with open(shard, "r+b") as f:
            header = struct.unpack("<Q", f.read(8))[0]
            f.seek(8 + header)
            size = shard.stat().st_size - 8 - header
            f.write(b"\xff" * size)  # 0xFFFF is a NaN in bf16 (and 0xFFFFFFFF in fp32)
    port = free_port()
    out = subprocess.run([sys.executable, "app.py", "--model", str(broken), "--device", "cpu", "--port", str(port),
                          "--history-dir", str(tmp_path / "h")], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "QWEN_CHAT_STARTSECS"})
    assert out.returncode == 78, out.stderr[-2000:]
    line = [l for l in out.stderr.splitlines() if l.startswith("app.py: cannot start the engine:")]
    assert line and "non-finite logit" in line[-1] and "weights are likely corrupt" in line[-1], out.stderr[-2000:]
