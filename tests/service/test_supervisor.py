"""Failure drills under a real ``supervisord``: the deploy configs adapted to the tiny model on a test port.

One supervisord runs the service for the module (start-up ~25-50 s on 2 CPU cores).  Drills, in order:

* status RUNNING, ``/healthz`` 200, ``/metrics`` parses with ``prometheus_client``'s parser and counts a UI turn;
* ``kill -9`` of the process serving the port while a UI reply streams (max new tokens 8192, so the reply is
  being checkpointed to history): Supervisor restarts it, RUNNING with ``/healthz`` 200 within 60 s of the kill,
  no process of the old process group left, every history JSON valid, the partial reply kept and marked
  ``interrupted`` (in the store and in the restarted UI), the same conversation can be continued;
* ``supervisorctl restart qwen3.5-9b`` while a reply streams: the same checks;
* the whole service killed as soon as it is healthy, five times in a row: restarted every time (never FATAL);
* a start-up that fails (model path that does not exist; an unknown flag) ends in FATAL after
  ``startretries`` attempts, with a readable reason in ``service.log``;
* a broken checkpoint (found after loading began, exit 78) ends EXITED after one attempt, as the README says;
* 2 CPU ranks (``NUM_CPU_RANKS=2``, one supervisord for both drills): ``kill -9`` of rank 1 mid-stream restarts
  the whole group; ``kill -9`` of the launcher leaves no orphan rank and Supervisor's first respawn succeeds.

Measured recovery times are printed (``pytest -s``) and recorded in docs/deployment.md ("Failure drills").
"""
from __future__ import annotations

import configparser
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client
from prometheus_client.parser import text_string_to_metric_families

from qwen_chat.history.store import HistoryStore
from tests.support.service_harness import (
    DEPLOY,
    PROGRAM,
    REPO,
    ServiceProcess,
    Supervisor,
    conversation_ids,
    health,
    group_pids,
    history_files,
    listening_pids,
    service_argv,
    ui_submit,
    wait_for_streaming_reply,
    wait_healthy,
)
from tests.support.servers import free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(600)]
#: reason: starts the real service (tiny model) under supervisord; ~30-90 s per drill on 2 CPU cores
drill = pytest.mark.slow

#: Back to RUNNING with /healthz 200 within this many seconds of the crash (the deployment target).
RECOVERY_LIMIT_S = 60.0
#: How long the drills wait for a recovery before giving up (longer than the limit, to measure slow ones).
WAIT_LIMIT_S = 180.0
#: First start-up bound (tiny model build is already cached; import + load + self-check on a busy 2-core box).
FIRST_START_S = 240.0


def metric_samples(base_url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of ``GET /metrics`` parsed by prometheus_client's parser."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (the service's process tree)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def tiny_cache(tiny_checkpoint) -> Path:
    """The ``--cache-dir`` holding the shared tiny checkpoint (built once per session by conftest)."""
    return Path(tiny_checkpoint).parent


def deploy_environment(**extra: str) -> str:
    """The ``environment=`` of deploy/qwen3.5-9b.conf with ``extra`` variables added (Supervisor's syntax), for
    drills that need more variables without losing the program's own (``QWEN_CHAT_STARTSECS``...)."""
    prog = configparser.RawConfigParser()
    prog.read(DEPLOY / "qwen3.5-9b.conf", encoding="utf-8")
    own = prog[f"program:{PROGRAM}"]["environment"]
    return ",".join([own] + [f'{key}="{value}"' for key, value in extra.items()])


@pytest.fixture(scope="module")
def supervised(tmp_path_factory, tiny_cache):
    """(Supervisor, base url, history dir) with the service RUNNING and healthy."""
    work = tmp_path_factory.mktemp("supervised")
    port = free_port()
    history = work / "history"
    sup = Supervisor(work, service_argv(port, history, tiny_cache))
    with sup:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        wait_healthy(url, timeout_s=FIRST_START_S)
        print(f"\n[drill] first start: /healthz 200 after {time.monotonic() - t0:.1f} s")
        # /healthz can answer before startsecs has passed; Supervisor says RUNNING only after it.
        sup.wait_state(["RUNNING"], timeout_s=float(sup.program_setting("startsecs")) + 30)
        yield sup, url, history


def check_history_valid(history: Path) -> list[dict]:
    """Every conversation JSON parses and has the schema's top-level fields; returns the parsed files."""
    files = history_files(history)
    assert files, f"no conversation saved under {history}"
    parsed = []
    for path in files:
        raw = path.read_bytes()
        assert raw, f"{path} is empty"
        data = json.loads(raw.decode("utf-8"))
        assert {"id", "messages", "revision"} <= data.keys(), path
        parsed.append(data)
    assert not list(history.glob("users/*/corrupt/*")), "a history file was set aside as corrupt"
    return parsed


def crash_drill(sup: Supervisor, url: str, history: Path, crash, min_chars: int = 20) -> dict:
    """Start a long UI reply, ``crash(old_pid, server_pid)`` once it is checkpointed, and check the recovery.

    Returns measured numbers for the report: seconds to RUNNING, to /healthz 200, characters kept.
    """
    old_pid = sup.pid()
    assert old_pid > 0
    old_tree = descendants(old_pid)
    port = int(url.rsplit(":", 1)[1])
    server = listening_pids(port)
    assert len(server) == 1 and server[0] in old_tree, (server, old_tree)

    client = Client(url + "/", verbose=False)
    earlier = conversation_ids(history)
    job = ui_submit(client, "Write a very long story about a lighthouse keeper.")
    conv_id, saved_chars = wait_for_streaming_reply(history, timeout_s=90, min_chars=min_chars, ignore=earlier)

    t_crash = time.monotonic()
    crash(old_pid, server[0])
    # Wait past the limit so a slow recovery is measured (and reported) rather than only failed.
    new_pid = wait_until(lambda: (p := sup.pid()) not in (0, old_pid) and p, WAIT_LIMIT_S,
                         "Supervisor to start a new service process")
    sup.wait_state(["RUNNING"], timeout_s=WAIT_LIMIT_S)
    t_running = time.monotonic() - t_crash
    wait_healthy(url, timeout_s=WAIT_LIMIT_S)
    t_healthy = time.monotonic() - t_crash
    job.cancel()
    print(f"\n[drill] recovered: RUNNING after {t_running:.1f} s, /healthz 200 after {t_healthy:.1f} s")
    assert t_healthy <= RECOVERY_LIMIT_S, (
        f"/healthz 200 only {t_healthy:.1f} s after the crash (limit {RECOVERY_LIMIT_S:.0f} s; "
        f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")

    # Nothing of the old process group or tree survives; the port belongs to the new process tree.
    assert group_pids(old_pid) == [], f"processes of the old group {old_pid} left: " + "; ".join(
        f"{p} {' '.join(_cmdline(p))[:160]}" for p in group_pids(old_pid))
    assert not [p for p in old_tree if p in descendants(new_pid) or _alive(p)], old_tree
    assert listening_pids(port) and set(listening_pids(port)) <= set(descendants(new_pid))

    # Every history file is valid JSON; the partial reply is kept and reads back as interrupted.
    check_history_valid(history)
    conv = HistoryStore(history).user("local").load(conv_id)
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[0].text == "Write a very long story about a lighthouse keeper."
    reply = conv.messages[1]
    assert reply.status == "interrupted"
    kept = len(reply.text) + len(reply.reasoning)
    assert kept >= saved_chars >= min_chars

    # The restarted UI shows it as interrupted, and the same conversation goes on (a page left open across
    # the restart keeps its history).
    fresh = Client(url + "/", verbose=False)
    listed = fresh.predict("", api_name="/conversations")["choices"]  # what the page does when it loads
    assert conv_id in [c[1] for c in listed]
    chat = fresh.predict(conv_id, api_name="/open")[0]
    shown = [p["text"] for m in chat if m["role"] == "assistant" for p in m["content"] if p["type"] == "text"
             and "reply-stats" not in p["text"]]  # the statistics line under a reply is a message of its own
    assert shown and "interrupted" in shown[-1]
    ui_submit(fresh, "Thanks, that is enough.", conv_id=conv_id, max_new_tokens=64).result(timeout=120)
    conv = HistoryStore(history).user("local").load(conv_id)
    assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert conv.messages[1].status == "interrupted" and conv.messages[3].status in ("complete", "length")
    return {"running_s": t_running, "healthy_s": t_healthy, "kept_chars": kept}


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@drill
def test_status_running_health_and_metrics(supervised):
    sup, url, history = supervised
    assert sup.state() == "RUNNING"
    out = sup.ctl("status", PROGRAM).stdout
    assert out.startswith(PROGRAM) and "RUNNING" in out and "pid" in out
    code, body = httpx.get(url + "/healthz", timeout=10).status_code, httpx.get(url + "/healthz").json()
    assert code == 200 and body["status"] == "ok"
    before = metric_samples(url)
    assert before[("qwen_chat_active_streams", frozenset())] == 0
    client = Client(url + "/", verbose=False)
    chat, conv_id = ui_submit(client, "Say hello.", max_new_tokens=64).result(timeout=120)[:2]
    after = metric_samples(url)
    assert after[("qwen_chat_requests_total", frozenset())] == before[("qwen_chat_requests_total", frozenset())] + 1
    assert after[("qwen_chat_completion_tokens_total", frozenset())] >= \
        before[("qwen_chat_completion_tokens_total", frozenset())] + 1
    assert after[("qwen_chat_ttft_seconds_count", frozenset())] == before[("qwen_chat_ttft_seconds_count", frozenset())] + 1
    conv = HistoryStore(history).user("local").load(conv_id)
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[1].status in ("complete", "length")
    assert "INFO qwen_chat: listening on http://" in sup.log_text()  # service.log is the program's log


@drill
def test_kill9_mid_stream_recovers_with_history_intact(supervised):
    sup, url, history = supervised

    def crash(old_pid: int, server_pid: int) -> None:
        os.kill(server_pid, signal.SIGKILL)

    result = crash_drill(sup, url, history, crash)
    print(f"[drill] kill -9 mid-stream: {result}")


@drill
def test_supervisorctl_restart_mid_stream(supervised):
    sup, url, history = supervised

    def crash(old_pid: int, server_pid: int) -> None:
        out = sup.ctl("restart", PROGRAM, timeout_s=RECOVERY_LIMIT_S + 30)
        assert "started" in out.stdout, out.stdout + out.stderr

    result = crash_drill(sup, url, history, crash)
    print(f"[drill] supervisorctl restart mid-stream: {result}")


#: Crashes right after each healthy start in the drill below: more than startretries + 1 (= 4), the number of
#: failed starts after which Supervisor gives up (FATAL) when it counts a crash as a failed start.
CRASHES_AFTER_HEALTHY = 5


@drill
def test_crash_right_after_each_healthy_start_is_always_restarted(supervised):
    """The whole service killed (``kill -9`` of its process group) as soon as ``/healthz`` says 200, five times
    in a row: each time Supervisor has already counted the start as done (the service turns ready only after
    ``startsecs``), so it restarts it instead of ending in FATAL after ``startretries`` "failed starts"."""
    sup, url, _ = supervised
    startsecs = float(sup.program_setting("startsecs"))
    for attempt in range(CRASHES_AFTER_HEALTHY):
        wait_healthy(url, timeout_s=WAIT_LIMIT_S)
        assert sup.state() == "RUNNING", (
            f"crash {attempt}: /healthz 200 while Supervisor still says {sup.state()} (startsecs {startsecs:.0f} "
            f"s): a crash now would count as a failed start; log tail:\n{sup.log_tail()}")
        pid = sup.pid()
        os.killpg(pid, signal.SIGKILL)
        wait_until(lambda: sup.pid() not in (0, pid), WAIT_LIMIT_S, "Supervisor to start the service again")
    wait_healthy(url, timeout_s=WAIT_LIMIT_S)
    assert sup.state() == "RUNNING"
    assert "gave up" not in (sup.workdir / "supervisord.log").read_text()
    print(f"\n[drill] {CRASHES_AFTER_HEALTHY} crashes right after healthy: restarted every time")


@drill
@pytest.mark.parametrize("bad_args,reason", [
    (("--model", "/nonexistent/path"),
     "app.py: cannot start the engine: No checkpoint folder at '/nonexistent/path'"),
    (("--model", "tiny", "--no-such-flag"), "app.py: error: unrecognized arguments: --no-such-flag"),
], ids=["missing-model", "bad-flag"])
def test_failed_startup_ends_fatal_with_readable_log(tmp_path, tiny_cache, bad_args, reason):
    assert_startup_ends_fatal(tmp_path, tiny_cache, bad_args, reason, free_port())


@drill
def test_busy_port_ends_fatal_instead_of_restarting_forever(tmp_path, tiny_cache):
    """The port is bound before the model loads, so a port taken by another program fails every attempt within
    startsecs and Supervisor gives up (FATAL) instead of counting each attempt as started."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        assert_startup_ends_fatal(tmp_path, tiny_cache, ("--model", "tiny"), f"app.py: cannot listen on 127.0.0.1:{port}", port,
                                  port_owned_elsewhere=True)


def assert_startup_ends_fatal(tmp_path, tiny_cache, bad_args, reason, port, port_owned_elsewhere=False):
    argv = service_argv(port, tmp_path / "history", tiny_cache)
    model_at = argv.index("--model")
    argv = argv[:model_at] + argv[model_at + 2:] + list(bad_args)
    sup = Supervisor(tmp_path / "sv", argv)
    t0 = time.monotonic()
    with sup:
        retries = int(sup.program_setting("startretries"))
        assert 1 <= retries <= 10
        startsecs = float(sup.program_setting("startsecs"))
        # A failing start-up must fail within startsecs: a run that outlives it counts as started, and
        # Supervisor then restarts it forever instead of giving up (FATAL).
        state = wait_until(lambda: (st := sup.state()) in ("FATAL", "RUNNING") and st, 240,
                           "FATAL (or RUNNING, which means the failure came too late)", poll_s=0.2)
        elapsed = time.monotonic() - t0
        assert state == "FATAL", (
            f"the failing start-up outlived startsecs={startsecs:.0f} s, so Supervisor counts it as started and "
            f"restarts it forever; load average {os.getloadavg()[0]:.1f}; log tail:\n{sup.log_tail(1500)}")
        log = sup.log_text()
        assert reason in log, log[-3000:]
        # one readable line per attempt (the reason is at the start of a line, not buried in a traceback)
        attempts = sum(1 for line in log.splitlines() if line.startswith(reason))
        assert attempts == retries + 1, f"{attempts} start attempts for startretries={retries}"
        time.sleep(2)  # FATAL is final: no further attempt is made
        assert sup.state() == "FATAL" and sup.log_text().count(reason) == log.count(reason)
        if not port_owned_elsewhere:
            assert listening_pids(port) == []
        assert "gave up" in (tmp_path / "sv" / "supervisord.log").read_text()
    print(f"\n[drill] failing start-up {bad_args}: FATAL after {elapsed:.1f} s, {attempts} attempts")


def test_deploy_program_file_as_the_system_supervisor_reads_it(tmp_path):
    """deploy/qwen3.5-9b.conf included from another folder (as /etc/supervisor/supervisord.conf does) resolves
    its paths to the repository and carries the restart, stop and log settings of the deployment."""
    from supervisor.datatypes import RestartWhenExitUnexpected
    from supervisor.options import ServerOptions

    main = tmp_path / "supervisord.conf"
    main.write_text(f"[supervisord]\nlogfile={tmp_path}/sd.log\npidfile={tmp_path}/sd.pid\n"
                    f"[include]\nfiles = {REPO / 'deploy' / 'qwen3.5-9b.conf'}\n")
    options = ServerOptions()
    options.realize(args=["-c", str(main)])
    [group] = options.process_group_configs
    [prog] = group.process_configs
    assert prog.name == PROGRAM
    argv = prog.command.split()
    assert argv[:2] == ["bash", str(REPO / "deploy" / ".." / "start.sh")]
    assert Path(argv[1]).resolve() == REPO / "start.sh"
    assert Path(prog.directory).resolve() == REPO
    assert Path(prog.stdout_logfile).resolve() == REPO / "service.log"
    assert prog.redirect_stderr and prog.stdout_logfile_maxbytes > 0 and prog.stdout_logfile_backups > 0
    # restart after any unexpected exit (crash, signal, dead rank: non-zero); 78 = the engine cannot start with
    # this configuration (app.py EXIT_STARTUP_FAILED), which must not loop
    assert prog.autorestart is RestartWhenExitUnexpected
    assert set(prog.exitcodes) == {0, 78}
    assert prog.stopasgroup and prog.killasgroup
    assert prog.stopsignal == signal.SIGTERM
    assert prog.stopwaitsecs >= 30  # a clean rank shutdown (exit message to every rank) fits
    assert 1 <= prog.startretries <= 10 and prog.startsecs >= 5
    # app.py holds exit 78 until startsecs have passed (an exit inside them is retried whatever its code)
    assert prog.environment["QWEN_CHAT_STARTSECS"] == str(prog.startsecs)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_cache):
    """(Supervisor, base url, history dir) for 2 CPU ranks through the DeepSpeed launcher
    (``NUM_CPU_RANKS=2 start.sh``), healthy; shared by the 2-rank drills (each leaves it healthy)."""
    work = tmp_path_factory.mktemp("two_ranks")
    port = free_port()
    history = work / "history"
    env = deploy_environment(NUM_CPU_RANKS="2", MASTER_PORT=str(free_port()))
    with Supervisor(work / "sv", service_argv(port, history, tiny_cache), extra_program={"environment": env}) as sup:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout_s=FIRST_START_S)
        yield sup, url, history


@drill
def test_worker_rank_killed_mid_stream_restarts_whole_group(two_ranks):
    """``kill -9`` of rank 1 while a reply streams makes rank 0 exit non-zero, the launcher ends the group, and
    Supervisor restarts it."""
    sup, url, history = two_ranks
    assert health(url)[1]["world_size"] == 2
    old_pid = sup.pid()
    workers = [p for p in descendants(old_pid) if "--local_rank=1" in " ".join(_cmdline(p))]
    assert len(workers) == 1, [(_cmdline(p)) for p in descendants(old_pid)]

    def crash(old: int, server_pid: int) -> None:
        assert server_pid != workers[0]
        os.kill(workers[0], signal.SIGKILL)

    result = crash_drill(sup, url, history, crash, min_chars=1)
    assert health(url)[1]["world_size"] == 2
    assert "exiting so the whole group restarts" in sup.log_text()
    print(f"[drill] kill -9 of rank 1 (2 CPU ranks) mid-stream: {result}")


def _cmdline(pid: int) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []


@drill
def test_killing_the_launcher_leaves_no_orphans_and_the_first_respawn_succeeds(two_ranks):
    """``kill -9`` of the DeepSpeed runner that Supervisor started (the process-group leader): the ranks notice
    their launcher is gone and exit on their own within about a second, so no unsupervised group keeps the GPUs
    and the port, and the group Supervisor starts at once binds the port on its first attempt."""
    sup, url, history = two_ranks
    wait_healthy(url, timeout_s=WAIT_LIMIT_S)
    port = int(url.rsplit(":", 1)[1])
    leader = sup.pid()  # start.sh exec's the deepspeed runner: it leads the program's process group
    assert len(group_pids(leader)) >= 4, group_pids(leader)  # runner, launch.py, 2 ranks
    sv_log = sup.workdir / "supervisord.log"
    spawns_before = sv_log.read_text().count(f"spawned: '{PROGRAM}'")
    log_before = len(sup.log_text())
    os.kill(leader, signal.SIGKILL)
    t0 = time.monotonic()
    wait_until(lambda: not group_pids(leader), 30, "every process of the killed launcher's group to exit")
    gone_s = time.monotonic() - t0
    assert not [p for p in listening_pids(port) if p not in descendants(sup.pid())]  # no orphan holds the port
    wait_healthy(url, timeout_s=WAIT_LIMIT_S)
    healthy_s = time.monotonic() - t0
    new_log = sup.log_text()[log_before:]  # (the orphans' own last words may not reach it: their pipe closed)
    assert "Address already in use" not in new_log, new_log[-3000:]
    assert sv_log.read_text().count(f"spawned: '{PROGRAM}'") == spawns_before + 1  # the first respawn served
    assert sup.state() == "RUNNING" or sup.wait_state(["RUNNING"], timeout_s=60)
    assert health(url)[1]["world_size"] == 2
    print(f"\n[drill] kill -9 of the launcher: all ranks gone after {gone_s:.1f} s, /healthz 200 after "
          f"{healthy_s:.1f} s on the first respawn")


@drill
def test_broken_checkpoint_ends_exited_78_after_one_attempt(tmp_path, tiny_checkpoint, tiny_cache):
    """A checkpoint whose weights file is cut off (an interrupted copy) is refused at start-up (exit 78), in one
    line naming the shard.  app.py holds that exit until Supervisor's startsecs have passed, so Supervisor counts
    the start as done, finds 78 in ``exitcodes`` and leaves the program EXITED after one attempt (instead of 4
    attempts and FATAL), while ``/healthz`` says why in the meantime."""
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_checkpoint, broken)
    weights = sorted(broken.glob("*.safetensors"))[0]  # one weights file cut off
    weights.write_bytes(weights.read_bytes()[:4096])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    reason = "app.py: cannot start the engine: "
    sup = Supervisor(tmp_path / "sv", service_argv(port, tmp_path / "history", tiny_cache, model=str(broken)))
    t0 = time.monotonic()
    with sup:
        startsecs = float(sup.program_setting("startsecs"))
        wait_until(lambda: reason in sup.log_text(), 240, "the start-up failure in service.log")
        failed_s = time.monotonic() - t0
        code, body = health(url)
        assert code == 503 and body["reason"].startswith("start-up failed: "), body
        state = wait_until(lambda: (st := sup.state()) in ("EXITED", "FATAL", "BACKOFF") and st, startsecs + 60,
                           "the program to end", poll_s=0.2)
        ended_s = time.monotonic() - t0
        assert state == "EXITED", sup.log_tail()
        assert "exited: qwen3.5-9b (exit status 78; expected)" in (sup.workdir / "supervisord.log").read_text()
        time.sleep(3)  # EXITED is final: no further attempt
        log = sup.log_text()
        assert sup.state() == "EXITED" and sum(line.startswith(reason) for line in log.splitlines()) == 1, log
        assert listening_pids(port) == []
        cause = log.split(reason, 1)[1].splitlines()[0]  # the cause, on the reason's line
        assert cause.startswith(f"{weights}: weight shard is truncated"), cause
    print(f"\n[drill] broken checkpoint: reason in the log after {failed_s:.1f} s, EXITED (78, expected) after "
          f"{ended_s:.1f} s, 1 attempt")


@drill
def test_sigterm_ends_an_open_api_stream_properly(tmp_path, tiny_cache):
    """SIGTERM (what Supervisor's stop and restart send) during a streamed API reply, twice in a row: the client
    still gets a final event (a ``service_unavailable`` error saying the reply was cut off by the shutdown) and
    ``data: [DONE]`` in a complete HTTP response (the engine is closed before the web server, the second signal is
    ignored), and the service exits with status 0.
    Found by a fresh-user check: the stream used to be cut off (app.py waited with Thread.join, which the
    signal's exception broke; see app.py)."""
    port = free_port()
    argv = service_argv(port, tmp_path / "history", tiny_cache)
    with ServiceProcess(argv, tmp_path / "service.log") as svc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout_s=FIRST_START_S)
        body = {"model": "tiny", "stream": True, "max_tokens": 8192,
                "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]}
        lines: list[str] = []
        signalled = False
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():  # raises if the response is cut off before its end
                    lines.append(line)
                    if not signalled and len([x for x in lines if x.startswith("data: {")]) == 5:
                        os.killpg(svc.proc.pid, signal.SIGTERM)
                        os.killpg(svc.proc.pid, signal.SIGTERM)
                        signalled = True
        except httpx.HTTPError as exc:
            try:
                svc.proc.wait(timeout=30)  # the whole log, shutdown included
            except subprocess.TimeoutExpired:
                pass
            raise AssertionError(f"the stream was cut off ({exc}); signalled: {signalled}; last lines: "
                                 f"{lines[-4:]}; service log:\n{svc.log_text()[-6000:]}") from exc
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert [x for x in lines if x][-1] == "data: [DONE]", lines[-4:]
        # The reply was cut by the shutdown, and the client is told so: an OpenAI-shaped error event, then [DONE].
        assert chunks[-1].get("error", {}).get("code") == "service_unavailable", chunks[-1]
        assert "shutting down" in chunks[-1]["error"]["message"]
        assert svc.proc.wait(timeout=30) == 0
        assert "SIGTERM: shutting down" in svc.log_text() and "Shutting down" in svc.log_text()  # uvicorn's
