"""Host-side measures of the service benchmark (``bench/serve_bench.py``): CPU time of the service's processes
and the GPU's busy share, sampled around a burst.

CPU: the service is ``bash start.sh`` in its own process group; its processes are the launched one and all its
descendants (``psutil.Process(pid).children(recursive=True)``), sorted by what they run (``role``): "front" is
the web front (``python -m qwen_chat.front_process``: uvicorn + Gradio + the API), "engine" every process whose
script is ``app.py`` (the engine of replica 0 is rank 0's app.py; with several ranks or replicas the other ranks'
app.py processes count as "engine" too: they run the same engine steps), "other" the rest (bash, the DeepSpeed
launcher).  ``cpu_snapshot`` reads user + system CPU seconds per process (all its threads, not its children's);
``cpu_delta`` is the difference of two snapshots per role (a process new in the second counts from 0; one gone
by then is lost).

GPU: ``GpuBusySampler`` runs ``nvidia-smi --query-gpu=utilization.gpu -lms 100`` in a background process and
time-stamps each line as it is read; ``busy_share`` is the mean utilization / 100 of the samples inside a time
window (all sampled GPUs averaged).  nvidia-smi's utilization is the share of its sample period in which a
kernel was running on the GPU, however few SMs it used: an upper bound of how busy the GPU was.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Iterable, Optional, Sequence

import psutil

ROLES = ("front", "engine", "other")


def role(cmdline: Sequence[str]) -> str:
    """What a process of the service runs, from its command line: "front" (``-m qwen_chat.front_process``),
    "engine" (the script is ``app.py``: ``python [-u ...] app.py ...``) or "other" (bash, the DeepSpeed runner
    or launcher, whose arguments name app.py but whose script or module is another)."""
    args = list(cmdline)
    if any("qwen_chat.front_process" in a for a in args):
        return "front"
    i = 1
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c"):  # a module or a command, not a script
            return "other"
        if a in ("-X", "-W"):  # options with a value
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return "engine" if os.path.basename(a) == "app.py" else "other"
    return "other"


def service_processes(pid: int) -> dict[str, list[psutil.Process]]:
    """The processes of the service launched as ``pid`` (it and all its descendants), by ``role``."""
    out: dict[str, list[psutil.Process]] = {r: [] for r in ROLES}
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            out[role(p.cmdline())].append(p)
        except psutil.Error:
            continue
    return out


def cpu_snapshot(pid: int) -> dict[str, dict[int, float]]:
    """{role: {pid: user + system CPU seconds}} of the service launched as ``pid`` now."""
    snap: dict[str, dict[int, float]] = {r: {} for r in ROLES}
    for r, procs in service_processes(pid).items():
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            snap[r][p.pid] = t.user + t.system
    return snap


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per role between two ``cpu_snapshot``s: the sum over the processes of ``after`` of their
    seconds less those of ``before`` (0 for a process started in between)."""
    return {r: sum(max(0.0, s - before.get(r, {}).get(pid, 0.0)) for pid, s in after.get(r, {}).items())
            for r in ROLES}


def us_per_token(cpu_s: Optional[float], tokens: Optional[int]) -> Optional[float]:
    """CPU microseconds per generated token; None without tokens or CPU time."""
    if cpu_s is None or not tokens:
        return None
    return cpu_s * 1e6 / tokens


def busy_share(samples: Iterable[tuple[float, float]], t0: float, t1: float) -> Optional[float]:
    """Mean utilization (percent) / 100 of the (time, percent) samples with ``t0 <= time <= t1``; None when
    none falls inside."""
    inside = [u for t, u in samples if t0 <= t <= t1]
    return sum(inside) / len(inside) / 100.0 if inside else None


class GpuBusySampler:
    """``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms PERIOD [-i IDS]`` in a
    background process; ``samples`` are (``time.perf_counter()`` when read, percent), one per GPU per period.
    ``start()`` returns None when nvidia-smi cannot run; it waits (up to ``wait_s``) for the first sample so that
    a burst sent next is covered from its start."""

    def __init__(self, ids: Optional[str] = None, period_ms: int = 100):
        self.cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                    "-lms", str(period_ms)] + (["-i", ids] if ids else [])
        self.samples: list[tuple[float, float]] = []
        self.proc: Optional[subprocess.Popen] = None
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._read, name="gpu-busy", daemon=True)

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip())))
                self._first.set()
            except ValueError:  # "[N/A]" or a message
                continue

    def start(self, wait_s: float = 10.0) -> Optional["GpuBusySampler"]:
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         bufsize=1)
        except OSError:
            return None
        self._thread.start()
        self._first.wait(wait_s)
        if not self.samples:
            self.stop()
            return None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def share(self, t0: float, t1: float) -> Optional[float]:
        return busy_share(list(self.samples), t0, t1)
