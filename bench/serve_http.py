"""HTTP side of the service benchmark: streamed chat completions timed as a client sees them, and statistics.

Everything goes through the OpenAI-compatible API (``POST /v1/chat/completions`` with ``"stream": true`` and
``stream_options.include_usage``).  One stream is timed from just before the request is sent:
``ttft_s`` to the first chunk whose ``delta`` carries text (``content`` or ``reasoning_content``; the role chunk's
empty ``content`` does not count), ``t_last`` to the last such chunk, ``end_s`` to ``data: [DONE]``; token counts
come from the final ``usage`` chunk.  Prompts are random words (``WORDS``: each one token of the Qwen3.5
tokenizer with its leading space), so their token count is linear in the word count; ``fit_tokens_per_word``
and ``words_for`` turn that into a word count for a wanted ``usage.prompt_tokens``.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import httpx

WORDS = tuple("""time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea kid
body information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education foot boy age policy process music market sense
nation plan college interest death experience effect use class control care field development role effort rate heart
drug show leader light voice wife police mind price report decision son view relationship town road arm difference
value building action model season society tax director position player record paper space ground form event
matter center couple site project activity star table need court oil situation cost industry figure street image
data picture practice piece land product doctor wall patient worker news test movie north love support technology
baby computer type attention film tree source organization hair window evidence population truth song energy river
garden stone cloud bread apple green blue red yellow small large quick slow bright dark happy simple strong open
early late final major local human social public private free full real short long high low young old great little
new first last other same different able ready clear certain hard easy common special whole recent sure run walk
talk read write speak think know feel bring begin keep hold turn start hear play move live believe happen carry sit
stand lose pay meet include continue set learn lead understand watch follow stop create allow add spend grow offer
remember consider appear buy wait serve die send expect build stay fall cut reach kill remain suggest raise pass sell
require decide return explain hope develop drive break receive agree pull""".split())


def random_prompt(words: int, rng: random.Random) -> str:
    """``words`` random words from ``WORDS``, space-separated (about ``words`` tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, int(words))))


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0-100) of ``values`` with linear interpolation between the closest ranks
    (numpy's default); None for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def fit_tokens_per_word(samples: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares line ``tokens = overhead + per_word * words`` through (words, prompt_tokens) samples.
    Returns (overhead tokens, tokens per word).  One sample: per_word 1 (the ``WORDS`` property), overhead the
    rest.  Raises ValueError for no samples."""
    if not samples:
        raise ValueError("no calibration samples")
    if len({w for w, _ in samples}) < 2:
        w, t = samples[0]
        return float(t - w), 1.0
    n = len(samples)
    mw = sum(w for w, _ in samples) / n
    mt = sum(t for _, t in samples) / n
    slope = sum((w - mw) * (t - mt) for w, t in samples) / sum((w - mw) ** 2 for w, _ in samples)
    return mt - slope * mw, slope


def words_for(target_tokens: int, overhead: float, per_word: float) -> int:
    """Words of a random prompt whose ``usage.prompt_tokens`` should be ``target_tokens`` (at least 1)."""
    return max(1, round((target_tokens - overhead) / per_word))


@dataclass
class StreamResult:
    """One streamed completion as the client saw it.  Times in seconds from just before the request was sent;
    ``status`` the HTTP status (0: no response); ``error`` the error message (HTTP error body, an SSE error
    event or the exception), None when the stream ended with ``[DONE]`` and no error; ``answer`` the streamed
    ``content``; ``cached_tokens`` from ``usage.prompt_tokens_details`` (prompt tokens the service did not
    prefill)."""

    status: int = 0
    error: Optional[str] = None
    ttft_s: Optional[float] = None
    t_last: Optional[float] = None
    end_s: Optional[float] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    text_chunks: int = 0
    finish_reason: Optional[str] = None
    answer: str = ""
    cached_tokens: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.completion_tokens is not None

    @property
    def decode_tok_s(self) -> Optional[float]:
        """Tokens per second after the first one: (completion_tokens - 1) / (t_last - ttft_s)."""
        if not self.ok or self.ttft_s is None or self.t_last is None or self.t_last <= self.ttft_s:
            return None
        return (self.completion_tokens - 1) / (self.t_last - self.ttft_s)


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error", {})
        return str(err.get("message") or err)[:400]
    except (ValueError, AttributeError):
        return text.strip()[:400]


async def stream_chat(client: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int,
                      model: Optional[str] = None, extra: Optional[dict] = None,
                      on_text: Optional[Callable[[float], None]] = None) -> StreamResult:
    """Send one streamed chat completion of ``prompt`` (one user message, the service's default sampling and
    thinking mode, ``max_tokens`` reasoning + answer tokens) and time it (``StreamResult``).  ``on_text`` is
    called with ``time.perf_counter()`` as each chunk carrying text arrives.  Never raises for HTTP or
    connection failures: they are in ``status`` / ``error``."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    if model:
        body["model"] = model
    res = StreamResult()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: " + _error_message(body)
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    res.end_s = time.perf_counter() - t0
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = _error_message(data)
                if event.get("usage"):
                    res.prompt_tokens = event["usage"].get("prompt_tokens")
                    res.completion_tokens = event["usage"].get("completion_tokens")
                    res.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    res.answer += delta.get("content") or ""
                    if delta.get("content") or delta.get("reasoning_content"):
                        now = time.perf_counter() - t0
                        if on_text is not None:
                            on_text(now + t0)
                        res.ttft_s = now if res.ttft_s is None else res.ttft_s
                        res.t_last = now
                        res.text_chunks += 1
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
        if res.end_s is None and res.error is None:
            res.error = "the stream ended without data: [DONE]"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:400]
    return res


def new_client(streams: int, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with room for ``streams`` concurrent connections and ``timeout_s`` seconds of
    read timeout (a queued request may wait long for its first byte)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4),
                             timeout=httpx.Timeout(timeout_s, connect=30.0))


async def _burst(base_url: str, prompts: Sequence[str], max_tokens: int, model: Optional[str]) -> tuple:
    async with new_client(len(prompts)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_chat(client, base_url, p, max_tokens, model) for p in prompts))
        return results, time.perf_counter() - t0


def burst(base_url: str, prompts: Sequence[str], max_tokens: int, model: Optional[str] = None) -> dict:
    """Send every prompt at once as its own stream and wait for all.  Returns the summary: ``streams``,
    ``ok``, ``refused`` (HTTP 429), ``failed``, ``wall_s`` (first send to last end, seconds),
    ``completion_tokens`` (sum over the streams that finished), ``aggregate_tok_s`` (that sum / ``wall_s``),
    ``ttft_ms_p50`` / ``ttft_ms_p99`` (milliseconds, over the streams that finished), ``decode_tok_s_p50`` (per
    stream, after its first token), ``prompt_tokens_mean`` and the first ``error`` message, if any."""
    results, wall = asyncio.run(_burst(base_url, list(prompts), max_tokens, model))
    return summarize(results, wall)


def summarize(results: Sequence[StreamResult], wall_s: float) -> dict:
    """The summary of ``burst`` from its ``StreamResult`` list and wall time in seconds."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    errors = [r.error for r in results if r.error]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {"streams": len(results), "ok": len(ok), "refused": sum(r.status == 429 for r in results),
            "failed": len(results) - len(ok), "wall_s": round(wall_s, 3), "completion_tokens": tokens,
            "aggregate_tok_s": tokens / wall_s if ok and wall_s > 0 else None,
            "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
            "decode_tok_s_p50": percentile([r.decode_tok_s for r in ok if r.decode_tok_s is not None], 50),
            "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
            "error": errors[0] if errors else None}


def warm_client(base_url: str) -> float:
    """Run this process's async HTTP client path once (a streamed ``GET /v1/models``, which reaches no model):
    its first use in a process costs about 40 ms of lazy imports and set-up (2-core CPU machine, 2026-12-04),
    which a timed request must not count as the service's.  Returns the milliseconds it took."""
    async def go():
        async with new_client(1) as client:
            async with client.stream("GET", base_url + "/v1/models") as resp:
                await resp.aread()
    t0 = time.perf_counter()
    asyncio.run(go())
    return (time.perf_counter() - t0) * 1e3


def one(base_url: str, prompt: str, max_tokens: int, model: Optional[str] = None,
        messages: Optional[list] = None) -> StreamResult:
    """One stream on its own (nothing else sent meanwhile); ``messages``: the whole conversation to send instead
    of one user message with ``prompt``."""
    extra = {"messages": messages} if messages is not None else None

    async def go():
        async with new_client(1) as client:
            return await stream_chat(client, base_url, prompt, max_tokens, model, extra)
    return asyncio.run(go())


def result_dict(r: StreamResult) -> dict:
    """A ``StreamResult`` as JSON-ready dict, with ``decode_tok_s``."""
    return {**asdict(r), "decode_tok_s": r.decode_tok_s}


def metric_values(text: str, name: str) -> list[float]:
    """The values of every sample of metric ``name`` (any labels) in a Prometheus text page."""
    return [float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)]


def metrics_gpu_gib(base_url: str) -> Optional[float]:
    """GiB of GPU memory the service reports in ``/metrics`` (``qwen_chat_gpu_memory_bytes``, summed over
    ranks), or None when it reports none or does not answer."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = metric_values(text, "qwen_chat_gpu_memory_bytes")
    return sum(values) / 2 ** 30 if values else None


def visible_gpus(env: Optional[dict] = None) -> Optional[str]:
    """The ``nvidia-smi -i`` list of the GPUs the service will use, as start.sh counts them: those of
    ``CUDA_VISIBLE_DEVICES`` (numeric ids) when set, the first ``NUM_GPUS`` of them when set; None: all."""
    env = os.environ if env is None else env
    ids = None
    if env.get("CUDA_VISIBLE_DEVICES", "").strip():
        ids = [x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
    if env.get("NUM_GPUS", "").strip().isdigit():
        ids = (nvidia_smi("index") or [] if ids is None else ids)[:int(env["NUM_GPUS"])]
    return ",".join(ids) if ids else None


def nvidia_smi(query: str, ids: Optional[str] = None) -> Optional[list[str]]:
    """``nvidia-smi --query-gpu=QUERY`` lines (one per GPU, no header or units; only GPUs ``ids``, an
    ``nvidia-smi -i`` list, when given), or None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
                             + (["-i", ids] if ids else []), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [l.strip() for l in out.stdout.splitlines() if l.strip()]
    return lines if out.returncode == 0 and lines else None


class GpuMemorySampler:
    """Samples ``nvidia-smi``'s used memory of the GPUs ``ids`` (None: all) every ``interval_s`` seconds in a
    thread; ``peak_gib`` is the largest sum over those GPUs seen (GiB; None without nvidia-smi).  ``mark()``
    returns the peak since the previous mark (per-phase peaks)."""

    def __init__(self, interval_s: float = 0.5, probe: Callable[[], Optional[list[str]]] = None,
                 ids: Optional[str] = None):
        self.interval_s = interval_s
        self._probe = probe or (lambda: nvidia_smi("memory.used", ids))
        self.peak_gib: Optional[float] = None
        self._phase_peak: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            lines = self._probe()
            if lines:
                gib = sum(float(x) for x in lines) / 1024.0  # MiB -> GiB
                self.peak_gib = gib if self.peak_gib is None else max(self.peak_gib, gib)
                self._phase_peak = gib if self._phase_peak is None else max(self._phase_peak, gib)
            self._stop.wait(self.interval_s)

    def start(self) -> "GpuMemorySampler":
        self._thread.start()
        return self

    def mark(self) -> Optional[float]:
        peak, self._phase_peak = self._phase_peak, None
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
