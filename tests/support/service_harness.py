"""Helpers for tests that run the real service as an operator would: through ``start.sh``, alone or under a real
``supervisord`` built from ``deploy/supervisord.conf`` + ``deploy/qwen3.5-9b.conf``.

Every helper has a bounded timeout and polls (``/healthz``, ``supervisorctl status``, the history folder)
instead of sleeping a fixed time.  Everything started here runs in its own session (process group), and the
context managers kill the whole group on exit, also when the test failed.

In-process servers (``free_port``, ``RunningServer``) are in ``tests/support/servers.py``; the polling wait
(``wait_until``) is ``tests/support/waiting.py``.

Public API::

    service_argv(port, history_dir, cache_dir, *extra) -> list[str]   # bash start.sh --model tiny ...
    wait_healthy(base_url, timeout_s=...) -> float                     # seconds until GET /healthz == 200
    health(base_url) -> tuple[int | None, dict]                        # status code (None: no answer), body
    group_pids(pgid) -> list[int]                                      # live processes of a process group
    listening_pids(port) -> list[int]                                  # processes with a socket LISTENing on port
    rank_pids(launcher_pid) -> dict[int, int]                          # {local rank: pid} below a DeepSpeed launcher
    history_files(history_dir) -> list[Path]                           # every conversation JSON
    conversation_ids(history_dir, user) -> frozenset[str]
    wait_for_streaming_reply(history_dir, user, timeout_s, min_chars, ignore) -> (conv_id, text_chars)
    ServiceProcess(argv, log_path)                                     # start.sh without Supervisor
    Supervisor(workdir, argv, program="qwen3.5-9b")                    # real supervisord on adapted configs
    UI_CONTROLS / ui_submit(client, text, conv_id, max_new_tokens)     # the UI's "/send" event

The tiny model folder is shared between runs: ``$QWEN_CHAT_CACHE_DIR`` when set, else the tests'
``tiny_checkpoint`` fixture decides (see ``tests/conftest.py``).  ``$QWEN_CHAT_START_SCRIPT`` overrides the
launcher (default: the repository's ``start.sh``); it exists only to try the drills against another launcher.
"""
from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx
import psutil

from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROGRAM = "qwen3.5-9b"
# thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, seed: the UI's "/send" inputs after
# (message, conversation id, system prompt).  Greedy decoding so the tiny model's reply length is reproducible.
UI_CONTROLS = [False, 8192, 0.0, 1.0, 20, 0.0, 1234]


def start_script() -> Path:
    """The launcher the drills run: ``$QWEN_CHAT_START_SCRIPT`` or the repository's ``start.sh``.

    Raises FileNotFoundError (with the path) when it does not exist.
    """
    path = Path(os.environ.get("QWEN_CHAT_START_SCRIPT") or REPO / "start.sh")
    if not path.is_file():
        raise FileNotFoundError(f"launcher {path} does not exist (start.sh is what Supervisor runs)")
    return path


def service_argv(port: int, history_dir: Path, cache_dir: Path, *extra: str, model: str = "tiny") -> list[str]:
    """``bash start.sh --model tiny --port PORT --history-dir DIR --cache-dir DIR [extra...]``."""
    return ["bash", str(start_script()), "--model", model, "--port", str(port), "--history-dir", str(history_dir),
            "--cache-dir", str(cache_dir), *extra]


def health(base_url: str, timeout_s: float = 5.0) -> tuple[Optional[int], dict]:
    """(HTTP status of ``GET /healthz``, its JSON body); (None, {}) when nothing answers on the port."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/healthz", timeout=timeout_s)
    except httpx.HTTPError:
        return None, {}
    try:
        body = r.json()
    except ValueError:
        body = {"raw": r.text[:200]}
    return r.status_code, body


def wait_healthy(base_url: str, timeout_s: float = 180.0, poll_s: float = 0.5) -> float:
    """Poll ``/healthz`` until it answers 200; return the seconds that took.

    Raises TimeoutError with the last status/body seen after ``timeout_s`` seconds.
    """
    start = time.monotonic()
    last: tuple[Optional[int], dict] = (None, {})
    while time.monotonic() - start < timeout_s:
        last = health(base_url)
        if last[0] == 200:
            return time.monotonic() - start
        time.sleep(poll_s)
    raise TimeoutError(f"{base_url}/healthz not 200 within {timeout_s:.0f} s; last answer: {last}")


def running(pid: int) -> bool:
    """True while ``pid`` is a live (non-zombie) process; False once it is gone, also when it exits while being
    looked at."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def listening_pids(port: int) -> list[int]:
    """Processes holding a TCP socket in LISTEN state on ``port`` (any address)."""
    pids = set()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            pids.add(conn.pid)
    return sorted(pids)


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{local rank: pid} of the rank processes below a DeepSpeed launcher (their ``--local_rank=N``)."""
    found = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            m = re.search(r"--local_rank=(\d+)", " ".join(child.cmdline()))
        except psutil.Error:
            continue
        if m:
            found[int(m.group(1))] = child.pid
    return found


def kill_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM then (after ``timeout_s``) SIGKILL every process of group ``pgid``; wait until none is left."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not group_pids(pgid):
            return


def history_files(history_dir: Path) -> list[Path]:
    """Every conversation JSON under a history folder (``users/<user>/conversations/*.json``)."""
    return sorted(Path(history_dir).glob("users/*/conversations/*.json"))


def _streaming_reply(history_dir: Path, user: str, ignore: frozenset = frozenset()) -> Optional[tuple[str, int]]:
    for path in history_files(history_dir):
        if path.parent.parent.name != user or path.stem in ignore:
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # being replaced right now; the next poll reads the new version
        for msg in data.get("messages", []):
            chars = len(msg.get("text", "")) + len(msg.get("reasoning", ""))
            if msg.get("role") == "assistant" and msg.get("status") == "streaming" and chars > 0:
                return data["id"], chars
    return None


def conversation_ids(history_dir: Path, user: str = "local") -> frozenset:
    """Ids of the conversations saved for ``user`` now (file names, no parsing)."""
    return frozenset(p.stem for p in history_files(history_dir) if p.parent.parent.name == user)


def wait_for_streaming_reply(history_dir: Path, user: str = "local", timeout_s: float = 90.0,
                             min_chars: int = 1, ignore: frozenset = frozenset()) -> tuple[str, int]:
    """Wait until ``user`` has a reply saved with status ``streaming`` and at least ``min_chars`` characters.

    Conversations in ``ignore`` are skipped (pass ``conversation_ids(...)`` taken before starting the reply: a
    reply cut off by an earlier crash stays ``streaming`` on disk until its next save).
    Returns (conversation id, characters saved so far: answer + reasoning).  Raises TimeoutError.
    """
    def ready():
        found = _streaming_reply(history_dir, user, ignore)
        return found if found and found[1] >= min_chars else None

    return wait_until(ready, timeout_s, f"a streaming reply of {user!r} saved under {history_dir}")


def ui_submit(client, text: str, conv_id: str = "", max_new_tokens: int = 8192):
    """Start the UI's ``/send`` event with ``gradio_client`` (returns the Job; the reply streams on)."""
    controls = list(UI_CONTROLS)
    controls[1] = max_new_tokens
    return client.submit({"text": text, "files": []}, conv_id, "", *controls, api_name="/send")


class ServiceProcess:
    """``start.sh`` run directly (no Supervisor) in its own session; output to ``log_path``.

    Context manager: ``__exit__`` kills the whole process group (SIGTERM, then SIGKILL after 15 s).
    """

    def __init__(self, argv: Sequence[str], log_path: Path, env: Optional[dict] = None):
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = env
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ServiceProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})})
        return self

    def log_text(self) -> str:
        """The service's output so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid, timeout_s=15.0)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _abs(path: Path) -> str:
    return str(Path(path).resolve())


class Supervisor:
    """A real ``supervisord`` (foreground, own session) on copies of the deploy configs adapted for a test.

    Kept from ``deploy/qwen3.5-9b.conf``: autorestart, startsecs, startretries, stopsignal, stopwaitsecs,
    stopasgroup, killasgroup, log rotation settings.  Changed: ``command`` (``argv``), ``directory`` (the
    repository), ``stdout_logfile`` (``workdir/service.log``) and every socket/pid/log path of
    ``deploy/supervisord.conf`` (into a short temp folder: UNIX socket paths are limited to ~100 bytes).

    Attributes: ``conf`` (the supervisord config used), ``service_log`` (Path), ``program`` (name).
    """

    def __init__(self, workdir: Path, argv: Sequence[str], program: str = PROGRAM,
                 extra_program: Optional[dict] = None):
        """Write the adapted configs into ``workdir`` (nothing is started yet; use ``start`` or ``with``).

        ``extra_program``: more settings for the program section, e.g. ``{"environment": 'NUM_CPU_RANKS="2"'}``.
        """
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.program = program
        self.service_log = self.workdir / "service.log"
        self.rundir = Path(tempfile.mkdtemp(prefix="qsv-"))
        self.conf = self.workdir / "supervisord.conf"
        self.program_conf = self.workdir / f"{program}.conf"
        self._write_configs(list(argv), extra_program or {})
        self.proc: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ configs
    def _write_configs(self, argv: list[str], extra: dict) -> None:
        section = f"program:{self.program}"
        prog = configparser.RawConfigParser()
        prog.optionxform = str  # keep key case
        prog.read(DEPLOY / "qwen3.5-9b.conf", encoding="utf-8")
        if section not in prog:
            raise AssertionError(f"deploy/qwen3.5-9b.conf has no [{section}] section")
        prog[section]["command"] = " ".join(_quote(a) for a in argv)
        prog[section]["directory"] = _abs(REPO)
        prog[section]["stdout_logfile"] = _abs(self.service_log)
        for key, value in extra.items():
            prog[section][key] = str(value)
        with open(self.program_conf, "w", encoding="utf-8") as f:
            prog.write(f)

        main = configparser.RawConfigParser()
        main.optionxform = str
        main.read(DEPLOY / "supervisord.conf", encoding="utf-8")
        sock = self.rundir / "supervisor.sock"
        main["unix_http_server"]["file"] = _abs(sock)
        main["supervisord"]["logfile"] = _abs(self.workdir / "supervisord.log")
        main["supervisord"]["pidfile"] = _abs(self.rundir / "supervisord.pid")
        main["supervisord"]["childlogdir"] = _abs(self.workdir)
        main["supervisorctl"]["serverurl"] = f"unix://{_abs(sock)}"
        main["include"]["files"] = _abs(self.program_conf)
        with open(self.conf, "w", encoding="utf-8") as f:
            main.write(f)

    def program_setting(self, key: str) -> str:
        """A setting of the program section as written for this test (e.g. ``startsecs``)."""
        prog = configparser.RawConfigParser()
        prog.read(self.program_conf, encoding="utf-8")
        return prog[f"program:{self.program}"][key]

    # ------------------------------------------------------------------ control
    def start(self, timeout_s: float = 30.0) -> "Supervisor":
        """Start supervisord in the foreground (``-n``) and wait until ``supervisorctl`` answers."""
        with open(self.workdir / "supervisord.out", "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-n", "-c", str(self.conf)],
                                         cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        wait_until(lambda: self.ctl("pid").returncode == 0 or self.proc.poll() is not None, timeout_s,
                   "supervisord to answer")
        if self.proc.poll() is not None:
            raise RuntimeError(f"supervisord exited with {self.proc.returncode}: "
                               f"{(self.workdir / 'supervisord.out').read_text(errors='replace')[-2000:]}")
        return self

    def ctl(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        """Run ``supervisorctl -c CONF ARGS...``; returns the CompletedProcess (text stdout/stderr)."""
        return subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.conf), *args],
                              capture_output=True, text=True, timeout=timeout_s, cwd=REPO)

    def state(self) -> str:
        """The program's state word from ``supervisorctl status`` (RUNNING, STARTING, BACKOFF, FATAL...)."""
        out = self.ctl("status", self.program).stdout.split()
        return out[1] if len(out) > 1 else "UNKNOWN"

    def pid(self) -> int:
        """The pid supervisord started (0 when the program is not running)."""
        out = self.ctl("pid", self.program).stdout.strip()
        return int(out) if out.isdigit() else 0

    def wait_state(self, wanted: Sequence[str], timeout_s: float) -> str:
        """Poll until the state is one of ``wanted``; returns it.  Raises TimeoutError with the log tail."""
        try:
            return wait_until(lambda: (s := self.state()) in wanted and s, timeout_s, f"state in {list(wanted)}",
                              poll_s=0.5)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; now {self.state()}; service.log tail:\n{self.log_tail()}") from None

    def log_text(self) -> str:
        """``service.log`` as written so far (the program's stdout + stderr)."""
        return self.service_log.read_text(encoding="utf-8", errors="replace") if self.service_log.exists() else ""

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of ``service.log`` (for failure messages)."""
        return self.log_text()[-chars:]

    def stop(self) -> None:
        """Shut supervisord down (it stops the program as configured), then kill anything left of both groups."""
        if self.proc is None:
            return
        child = self.pid()
        try:
            self.ctl("shutdown", timeout_s=90)
            self.proc.wait(timeout=90)
        except (subprocess.TimeoutExpired, OSError):
            pass
        kill_group(self.proc.pid, timeout_s=5.0)
        if child:
            kill_group(child, timeout_s=5.0)
        self.proc = None
        shutil.rmtree(self.rundir, ignore_errors=True)

    def __enter__(self) -> "Supervisor":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _quote(arg: str) -> str:
    """Quote one argument for supervisor's shlex-based command parsing."""
    return shlex.quote(arg)
