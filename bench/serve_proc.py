"""The service under benchmark: started as the README says (``bash start.sh --model CKPT``), stopped for sure.

``Service`` launches ``start.sh`` in its own process group with its output appended to a log file, waits for
``/healthz`` to answer 200 (``startup_s`` counts from the launch), and ``stop()`` ends the whole group
(SIGTERM, then SIGKILL): the DeepSpeed launcher and every rank.  ``cap_sitecustomize`` writes the
``sitecustomize.py`` that caps the CUDA caching allocator of the service's processes
(``torch.cuda.set_per_process_memory_fraction``) for the 24 GB run, without any flag of the service changed.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]
FRACTION_ENV = "SERVE_BENCH_MEMORY_FRACTION"

# Runs in every Python process started with its folder first on PYTHONPATH.  Only the service's own processes
# (app.py, or a DeepSpeed rank: LOCAL_RANK set) are capped, and only when torch initialises CUDA
# (torch.cuda._lazy_call), so the launcher never opens a CUDA context and importing torch stays lazy.  Any other
# sitecustomize further down the path still runs.
SITECUSTOMIZE = r'''
import importlib.abc, importlib.machinery, importlib.util, os, sys

_FRACTION = float(os.environ.get("%(env)s") or 0)
_HERE = os.path.dirname(os.path.abspath(__file__))


def _cap(torch):
    def apply():
        dev = int(os.environ.get("LOCAL_RANK") or 0)
        dev = dev if dev < torch.cuda.device_count() else 0
        with torch.cuda.device(dev):
            torch.cuda.set_per_process_memory_fraction(_FRACTION, dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        print(f"sitecustomize: CUDA allocator of pid {os.getpid()} capped at {_FRACTION * total / 2**30:.2f} GiB "
              f"(fraction {_FRACTION:.4f} of cuda:{dev})", file=sys.stderr, flush=True)
    torch.cuda._lazy_call(apply)  # runs when (if ever) this process initialises CUDA


class _AfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _cap(module)
            spec.loader.exec_module = exec_module
        return spec


_argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
if _FRACTION > 0 and (_argv0 == "app.py" or os.environ.get("LOCAL_RANK") is not None):
    sys.meta_path.insert(0, _AfterTorch())

_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    _next.loader.exec_module(_module)
'''


def cap_sitecustomize(folder: Path) -> Path:
    """Write the capping ``sitecustomize.py`` into ``folder``; the fraction is read from
    ``$SERVE_BENCH_MEMORY_FRACTION`` (``FRACTION_ENV``) at start-up (0 or unset: no cap).  Returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sitecustomize.py"
    path.write_text(SITECUSTOMIZE % {"env": FRACTION_ENV})
    return path


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def startup_error_line(log_text: str) -> Optional[str]:
    """The line that says why a start-up failed: the last ``app.py: ...`` line of the service's output (its
    one-line reasons: "cannot start the engine", "cannot listen", "error", "configuration error"), else the
    last line naming an error, else the last non-empty line; None for an empty log."""
    lines = [l.strip() for l in log_text.splitlines() if l.strip()]
    for pick in (lambda l: l.startswith("app.py: "), lambda l: "Error" in l or "error:" in l.lower()):
        found = [l for l in lines if pick(l)]
        if found:
            return found[-1][:500]
    return lines[-1][:500] if lines else None


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_PHASES = {  # phase -> (a pattern of its start-up log line whose group 1 is its seconds)
    "load": re.compile(r"parameters held .*, load ([\d.]+) s"),
    "decode_graphs": re.compile(r"captured \d+ decode graphs in ([\d.]+) s"),
    "prefill_graphs": re.compile(r"captured \d+ prefill graphs .* in ([\d.]+) s"),
    "sampler": re.compile(r"compiled the sampler in ([\d.]+) s"),
    "warm_up": re.compile(r"warmed up the prefill kernels .* in ([\d.]+) s"),
}
_TRITON = re.compile(r"(\d+) Triton kernels compiled \(([\d.]+) s\)")
_BEFORE = re.compile(r"before loading the weights: [\d.]+ s: (.*)$")


def _stamp(line: str) -> Optional[float]:
    m = _STAMP.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3


def startup_phases(log_text: str) -> dict:
    """Seconds of each start-up phase in one start's service log (rank 0's lines): ``imports`` (from the web
    front listening to the engine starting to load), ``load``, ``decode_graphs``, ``prefill_graphs``,
    ``sampler``, ``warm_up``, ``before_loading`` ({step: seconds} of the imports phase, rank 0's "before
    loading the weights" line: imports, device, process groups, engine modules, checkpoint), and
    ``triton_kernels_compiled`` / ``triton_compile_s`` summed over the phases
    that report them (``startup.compile_stats``); a phase the log does not show is absent."""
    out: dict = {}
    listening = loading = None
    for line in log_text.splitlines():
        if listening is None and "listening on http" in line:
            listening = _stamp(line)
        elif loading is None and ": loading " in line and "rank 0" in line:
            loading = _stamp(line)
        for phase, pattern in _PHASES.items():
            if phase not in out and (m := pattern.search(line)):
                out[phase] = float(m.group(1))
        if "before_loading" not in out and (b := _BEFORE.search(line)):
            out["before_loading"] = {name.replace(" ", "_"): float(secs) for name, secs in
                                     re.findall(r"([a-z][a-z ]*?) ([\d.]+) s", b.group(1))}
        if t := _TRITON.search(line):  # (the phases' lines and the warm-up's compilation line)
            out["triton_kernels_compiled"] = out.get("triton_kernels_compiled", 0) + int(t.group(1))
            out["triton_compile_s"] = round(out.get("triton_compile_s", 0.0) + float(t.group(2)), 1)
    if listening is not None and loading is not None:
        out["imports"] = round(loading - listening, 1)
    return out


def kernel_lines(log_text: str) -> dict:
    """The Gated DeltaNet kernels the service reports at start-up (``kernel: OP -> IMPL`` log lines), as
    {op: impl}: the server side's word on whether fla's kernels are in use."""
    found = {}
    for line in log_text.splitlines():
        if "kernel: " in line and " -> " in line:
            op, impl = line.split("kernel: ", 1)[1].split(" -> ", 1)
            found[op.strip()] = impl.strip()
    return found


class Service:
    """One run of ``bash start.sh ARGS`` (repository root, own process group, output appended to ``log``)."""

    def __init__(self, args: list[str], port: int, log: Path, env: Optional[dict] = None):
        self.args, self.port, self.log = list(args), port, Path(log)
        self.env = {**os.environ, **(env or {})}
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None
        self.error: Optional[str] = None
        self._log_start = 0

    @property
    def command(self) -> str:
        return " ".join(["bash", "start.sh", *self.args])

    def start(self, timeout_s: float) -> bool:
        """Launch and wait until ``/healthz`` answers 200 (True; ``startup_s`` = seconds from the launch), or the
        process exits or ``timeout_s`` seconds pass (False; ``error`` says why, from the log)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as fh:
            fh.write(f"\n# serve_bench {time.strftime('%Y-%m-%d %H:%M:%S')}: {self.command}\n")
            self._log_start = fh.tell()
            t0 = time.monotonic()
            self.proc = subprocess.Popen(["bash", "start.sh", *self.args], cwd=ROOT, stdout=fh,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    self.error = (f"exit {self.proc.returncode}: "
                                  f"{startup_error_line(self.log_text()) or 'no output'}")
                    return False
                try:
                    if client.get(self.base_url + "/healthz").status_code == 200:
                        self.startup_s = time.monotonic() - t0
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.error = f"/healthz not 200 after {timeout_s:.0f} s: {startup_error_line(self.log_text()) or 'no output'}"
        return False

    def start_retrying(self, timeout_s: float = 600, attempts: int = 2, who: str = "bench") -> bool:
        """``start``, once more if the first start fails (2 busy cores can make a start-up miss its deadlines);
        False, with the reason printed to stderr as ``who: ...``, when it never starts."""
        for i in range(attempts):
            if self.start(timeout_s):
                return True
            self.stop()
            print(f"{who}: the service did not start (attempt {i + 1}): {self.error}", file=sys.stderr)
        return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        """What this run wrote to the log so far."""
        try:
            with open(self.log, errors="replace") as fh:
                fh.seek(self._log_start)
                return fh.read()
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> Optional[int]:
        """End the whole process group: SIGTERM, SIGKILL after ``grace_s`` seconds; then SIGKILL whatever of the
        group is left (ranks whose launcher died first).  Returns the launcher's exit code.  Safe to repeat."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the group id is the launcher's pid
        if self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return None


def server_versions(env: Optional[dict] = None) -> dict:
    """Package versions in the interpreter start.sh runs (``$PYTHON`` or python3, with the service's
    environment): torch, CUDA, transformers, fla-core, flash-linear-attention, triton, deepspeed."""
    code = ("import json, importlib.metadata as md\n"
            "out = {}\n"
            "for n in ('torch', 'transformers', 'fla-core', 'flash-linear-attention', 'triton', 'deepspeed'):\n"
            "    try: out[n] = md.version(n)\n"
            "    except Exception: out[n] = None\n"
            "try:\n"
            "    import torch; out['cuda'] = torch.version.cuda\n"
            "except Exception: pass\n"
            "print(json.dumps(out))\n")
    env = {**os.environ, **(env or {})}
    env.pop(FRACTION_ENV, None)
    try:
        out = subprocess.run([env.get("PYTHON", "python3"), "-c", code], capture_output=True, text=True,
                             timeout=120, env=env, cwd=ROOT)
        import json
        return {"source": "the service's interpreter (start.sh: $PYTHON or python3)",
                **json.loads(out.stdout.strip().splitlines()[-1])}
    except Exception as exc:  # noqa: BLE001 - context only
        return {"source": f"unavailable: {type(exc).__name__}: {exc}"[:300]}
