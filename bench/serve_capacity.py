"""The 24 GB phase of ``serve_bench.py``: the service restarted with its CUDA allocator capped at ``CAP_GIB``
(a ``sitecustomize.py`` on PYTHONPATH calls ``torch.cuda.set_per_process_memory_fraction``; no flag changed),
bursts of 8 and 32 streams, then the long-context check: how many sequences of a long context (32k tokens) the
service holds at once, as a user who sends that many at once meets it.

It reads the service's memory plan from ``/v1/models`` (``engine``: state slots, KV tokens), sends ``streams``
prompts of ``tokens`` tokens at once (each asking for ``new_tokens`` tokens), and samples ``/metrics`` every
0.25 s meanwhile: the most sequences running at once (``qwen_chat_running_sequences``) and how many were
preempted (``qwen_chat_engine_preemptions_total``, difference over the phase).  ``kv_fit`` is what the plan
allows by arithmetic: KV tokens // (tokens + new_tokens), capped by the state slots.  ``max_running`` only
reaches ``kv_fit`` when the sequences live long enough: with few ``new_tokens`` each one finishes soon after
its prefill, so the prefill rate bounds it (measured: docs/performance.md, "FP8 weights").
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import httpx

import serve_http as H
import serve_report as R
from serve_proc import FRACTION_ENV, Service, cap_sitecustomize

#: The allocator cap of the 24 GB phase (GiB): a 24 GB card less what the driver and CUDA context take.
CAP_GIB = 22.5


class MetricsSampler:
    """Polls ``/metrics`` in a thread: ``max_running`` (most sequences running in one sample) and the first /
    last ``preemptions`` counter value seen."""

    def __init__(self, url: str, period_s: float = 0.25):
        self.url, self.period_s = url, period_s
        self.max_running = 0.0
        self.preemptions: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                try:
                    text = client.get(self.url + "/metrics").text
                    self.max_running = max(self.max_running, sum(H.metric_values(text, "qwen_chat_running_sequences")))
                    self.preemptions.append(sum(H.metric_values(text, "qwen_chat_engine_preemptions_total")))
                except httpx.HTTPError:
                    pass
                self._stop.wait(self.period_s)

    def __enter__(self) -> "MetricsSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def long_context(url: str, model: Optional[str], prompt: Callable[[int], str], *, tokens: int, streams: int,
                 new_tokens: int) -> dict:
    """Run the phase; returns {"tokens", "streams", "engine" (``/v1/models`` engine report), "kv_fit"
    (sequences of ``tokens + new_tokens`` the KV cache holds at once by arithmetic, capped by the state slots),
    "max_running" (most running at once, sampled), "preemptions", and ``serve_http.burst``'s summary under
    "burst" (ok / refused / failed counts, TTFT, wall seconds)}."""
    engine = httpx.get(url + "/v1/models", timeout=30).json()["data"][0].get("engine", {})
    kv_fit = None
    if engine.get("kv_tokens"):
        kv_fit = min(engine["kv_tokens"] // (tokens + new_tokens), engine.get("state_slots") or 10 ** 9)
    prompts = [prompt(tokens) for _ in range(streams)]
    t0 = time.monotonic()
    with MetricsSampler(url) as sampler:
        summary = H.burst(url, prompts, new_tokens, model)
    pre = sampler.preemptions
    return {"tokens": tokens, "streams": streams, "new_tokens": new_tokens, "engine": engine, "kv_fit": kv_fit,
            "max_running": int(sampler.max_running), "preemptions": int(pre[-1] - pre[0]) if len(pre) > 1 else None,
            "wall_s": round(time.monotonic() - t0, 1), "burst": summary}


def capped_service(bench, model_arg: str, port: int, log: Path, progress: Callable[[str], None]) -> None:
    """Run the phase for ``bench`` (``serve_bench.Bench``: its sizes ``P``, environment, prompt maker, result
    dict ``cap24`` and list of services to stop); the service is stopped on every exit."""
    total = H.nvidia_smi("memory.total", H.visible_gpus()) if bench.gpus else None
    # No GPU (--smoke): fraction 1, so the sitecustomize still hooks the service's torch import (the
    # mechanism is exercised) while CUDA never starts and nothing is capped.
    fraction = CAP_GIB * 1024 / float(total[0]) if total else 1.0
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-cap-"))
    cap_sitecustomize(tmp)
    env = {FRACTION_ENV: f"{fraction:.6f}",
           "PYTHONPATH": str(tmp) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    svc = Service(bench.service_argv(model_arg, port), port, log, {**bench.env, **env})
    bench.services.append(svc)
    cap = bench.cap24 = {"started": False, "cap_gib": CAP_GIB, "fraction": round(fraction, 6),
                         "note": None if total else "no GPU: the sitecustomize hooks torch but nothing is capped",
                         "error": None, "startup_s": None, "bursts": {}}
    progress(f"starting the service with the allocator capped at {CAP_GIB} GiB (fraction {fraction:.4f}"
             + ("" if total else "; no GPU: nothing to cap") + ")")
    try:
        if not svc.start(bench.P["startup_timeout_s"]):
            cap["error"] = svc.error
            progress(f"capped service did not start: {svc.error}")
            return
        cap.update(started=True, startup_s=svc.startup_s)
        progress(f"capped service up after {svc.startup_s:.1f} s")
        bench.phase_memory("cap24_after_startup", svc.base_url)
        model = httpx.get(svc.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        if bench.detail["calibration"] is None:  # --cap24-only: no uncapped service measured the tokenizer
            bench.calibrate(svc.base_url, model)
        for streams in R.CAP_CONCURRENCY:
            bench.run_burst(svc.base_url, model, streams, cap["bursts"], "cap24 ")
            bench.save()
        L = bench.P["cap_long"]
        progress(f"cap24: {L['streams']} prompts of {L['tokens']} tokens at once")
        lc = cap["long_context"] = long_context(svc.base_url, model, bench.prompt, **L)
        progress(f"cap24 long context: the KV cache holds {lc['kv_fit']} at once by arithmetic, {lc['max_running']} "
                 f"ran at once, {lc['burst']['ok']}/{L['streams']} ok, {lc['preemptions']} preemptions, {lc['wall_s']} s")
        bench.save()
        if not svc.alive():
            cap["error"] = f"the service exited: {svc.error or svc.proc.returncode}"
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
