"""Health and Prometheus metrics: ``/healthz``, ``/metrics`` and the metrics-recording backend wrapper.

Wiring (in the web server)::

    backend = ops.instrument(engine)               # give THIS object to the UI and the API
    app.include_router(ops.create_router(backend)) # GET /healthz, GET /metrics

``instrument`` wraps any ``ChatBackend`` and records, for every ``stream_chat`` call (UI and API alike), the
metrics below in its own ``prometheus_client.CollectorRegistry`` (never the global one, so several apps can
live in one process).  Metric names (Prometheus text format, ``/metrics``):

- ``qwen_chat_requests_total``: chat requests made (every ``stream_chat`` call, plus requests the API
  rejected before reaching the engine, see ``record_rejection``).
- ``qwen_chat_errors_total{kind}``: failed requests by ``ChatError.kind`` (``invalid_input``, ``busy``,
  ``not_ready``...); ``internal`` for unexpected exceptions, ``generation`` for a stream that ended with
  ``finish_reason == "error"``.
- ``qwen_chat_finished_total{finish_reason}``: streams that ended, by finish reason (stop/length/cancelled/error).
- ``qwen_chat_active_streams``: streams being generated now.
- ``qwen_chat_prompt_tokens_total`` / ``qwen_chat_completion_tokens_total``: tokens, summed over requests.
- ``qwen_chat_ttft_seconds``: histogram of time to first token (the engine's ``ttft_s`` when it reports one,
  else wall time from the call to the first update carrying text).
- ``qwen_chat_decode_tokens_per_second``: histogram of per-request decode speed
  (``(completion_tokens - 1) / (t_last - t_first)``, measured after the first token, so prefill is excluded).
- From ``backend.stats()`` if the backend has it, read at scrape time: ``qwen_chat_queue_depth`` (key
  ``queue_depth``), ``qwen_chat_running_sequences`` (key ``running``), ``qwen_chat_gpu_memory_bytes{rank}``
  (key ``gpu_memory_bytes``: a list indexed by rank or a {rank: bytes} dict), and any other numeric key ``K``
  as ``qwen_chat_engine_K`` (a counter when ``K`` ends in ``_total``, else a gauge).
- ``qwen_chat_healthy``: 1 when ``backend.health()["ok"]``, else 0 (read at scrape time).

Several data-parallel replicas (``backend.stats()`` returns ``{"replicas": {"0": stats, "1": ...}}``, the
router's): every series read from ``stats()`` carries a ``replica`` label ("0", "1", ...), e.g.
``qwen_chat_running_sequences{replica="1"}``, ``qwen_chat_engine_requests_total{replica="0"}``,
``qwen_chat_gpu_memory_bytes{replica="1",rank="2"}``, and the router's ``qwen_chat_engine_routed_total`` /
``qwen_chat_engine_routed_affinity_total`` (requests sent there; of them, later turns of a conversation sent to
its replica).  Tokens per second of a replica: ``rate(qwen_chat_engine_generated_tokens_total{replica="1"}[1m])``.
The request metrics above (recorded at the front) stay unlabelled totals.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qwen_chat.chat_types import CancelToken, ChatBackend, ChatError, ChatMessage, GenerationSettings, StreamUpdate
from qwen_chat.web.front import health_report

log = logging.getLogger(__name__)

# Bucket edges.  TTFT: from ~10 ms (short prompt on a GPU) to minutes (long multimodal prompt, ZeRO-3 offload
# on CPU).  Decode speed per request: from well under 1 tok/s (ZeRO-3 CPU offload) to about 200 tok/s
# (batch-1 decode on one H200; measured: docs/performance.md).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKENS_PER_S_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 35.0, 50.0, 75.0, 100.0, 150.0, 250.0, 500.0)

OPS_THREADS = 4  # worker threads reserved for /healthz and /metrics

_METRIC_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


class _BackendCollector(Collector):
    """Reads ``backend.stats()`` and ``backend.health()`` at scrape time and turns them into gauges; a
    ``{"replicas": {label: stats}}`` result gives every series a ``replica`` label."""

    def __init__(self, backend: Any):
        self._backend = backend

    def collect(self):  # noqa: D401 - prometheus_client interface
        healthy = GaugeMetricFamily("qwen_chat_healthy", "1 when /healthz would answer 200, else 0")
        try:
            healthy.add_metric([], 1.0 if bool(self._backend.health().get("ok")) else 0.0)
        except Exception:  # a failing health() is itself "unhealthy"
            healthy.add_metric([], 0.0)
        yield healthy
        stats_fn = getattr(self._backend, "stats", None)
        if not callable(stats_fn):
            return
        try:
            stats = stats_fn() or {}
        except Exception:
            log.exception("backend.stats() failed during /metrics scrape")
            return
        per_replica = stats.get("replicas")
        groups = [((), (), stats)] if not isinstance(per_replica, dict) else [
            (("replica",), (str(label),), s) for label, s in per_replica.items()]
        families: dict[str, Any] = {}
        for names, values, one in groups:
            for key, value in one.items():
                _add_stat(families, names, values, key, value)
        yield from families.values()


def _add_stat(families: dict, names: tuple, values: tuple, key: str, value: Any) -> None:
    """Add one ``stats()`` entry (labels ``names`` = ``values``) to its family in ``families`` (name -> family;
    created on first use), named as the module docstring says."""
    if key == "gpu_memory_bytes":
        fam = families.get("qwen_chat_gpu_memory_bytes") or GaugeMetricFamily(
            "qwen_chat_gpu_memory_bytes", "GPU memory allocated by the model process, per rank",
            labels=[*names, "rank"])
        for rank, used in value.items() if isinstance(value, dict) else enumerate(value or ()):
            fam.add_metric([*values, str(rank)], float(used))
        families[fam.name] = fam
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if key == "queue_depth":
        name, doc = "qwen_chat_queue_depth", "requests waiting for a free engine slot"
    elif key == "running":
        name, doc = "qwen_chat_running_sequences", "sequences being decoded now"
    else:
        name, doc = "qwen_chat_engine_" + _METRIC_NAME_RE.sub("_", str(key)), f"engine stat {key}"
    counter = name.endswith("_total")  # a counter since start (prometheus_client appends _total again)
    family_name = name[: -len("_total")] if counter else name
    fam = families.get(family_name)
    if fam is None:
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        fam = families[family_name] = kind(family_name, doc, labels=list(names))
    fam.add_metric(list(values), float(value))


class InstrumentedBackend:
    """A ``ChatBackend`` that forwards to ``inner`` and records metrics in ``self.registry``.

    Every attribute other than ``stream_chat``/``record_rejection``/``registry`` is the inner backend's
    (``info``, ``health``, ``stats``...), so the wrapper can stand in for the engine everywhere.
    """

    def __init__(self, inner: ChatBackend, registry: Optional[CollectorRegistry] = None):
        self.inner = inner
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("qwen_chat_requests", "chat requests made (UI and API)", registry=r)
        self.errors = Counter("qwen_chat_errors", "failed chat requests by error kind", ["kind"], registry=r)
        self.finished = Counter("qwen_chat_finished", "streams ended, by finish reason", ["finish_reason"], registry=r)
        self.active = Gauge("qwen_chat_active_streams", "streams being generated now", registry=r)
        self.prompt_tokens = Counter("qwen_chat_prompt_tokens", "prompt tokens processed", registry=r)
        self.completion_tokens = Counter("qwen_chat_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("qwen_chat_ttft_seconds", "time to first token", buckets=TTFT_BUCKETS_S, registry=r)
        self.tokens_per_s = Histogram(
            "qwen_chat_decode_tokens_per_second", "decode speed per request (after the first token)",
            buckets=TOKENS_PER_S_BUCKETS, registry=r,
        )
        r.register(_BackendCollector(inner))

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper itself.
        return getattr(self.inner, name)

    def record_rejection(self, kind: str) -> None:
        """Count a chat request refused before it reached the engine (e.g. API parameter validation)."""
        self.requests.inc()
        self.errors.labels(kind=kind).inc()

    def health(self) -> dict:
        """The inner backend's ``health()``."""
        return self.inner.health()

    def stream_chat(
        self, messages: Sequence[ChatMessage], settings: GenerationSettings, cancel: CancelToken
    ) -> Iterator[StreamUpdate]:
        """Same contract as ``ChatBackend.stream_chat``; closing this generator closes the inner one."""
        self.requests.inc()
        tally, inner = _Tally(self), None
        try:
            inner = iter(self.inner.stream_chat(messages, settings, cancel))
            for update in inner:
                tally.see(update)
                yield update
        except Exception as exc:
            tally.failed = True
            self._count_error(exc)
            raise
        finally:
            if inner is not None and hasattr(inner, "close"):
                inner.close()
            tally.end()

    @property
    def supports_async(self) -> bool:
        """Whether the inner backend has a native ``astream_chat``."""
        return bool(getattr(self.inner, "supports_async", False))

    async def astream_chat(self, messages: Sequence[ChatMessage], settings: GenerationSettings,
                           cancel: CancelToken) -> AsyncIterator[StreamUpdate]:
        """``stream_chat``'s metrics around the inner backend's ``astream_chat`` (only when
        ``supports_async``); raises what it raises, before returning."""
        self.requests.inc()
        try:
            inner = await self.inner.astream_chat(messages, settings, cancel)
        except Exception as exc:
            self._count_error(exc)
            raise
        return self._counted(inner)

    async def _counted(self, inner: AsyncIterator[StreamUpdate]) -> AsyncIterator[StreamUpdate]:
        tally = _Tally(self)
        try:
            async for update in inner:
                tally.see(update)
                yield update
        except Exception as exc:
            tally.failed = True
            self._count_error(exc)
            raise
        finally:
            await inner.aclose()
            tally.end()

    def _count_error(self, exc: Exception) -> None:
        self.errors.labels(kind=exc.kind if isinstance(exc, ChatError) else "internal").inc()

    def _record_end(self, last: Optional[StreamUpdate], first_at: Optional[float], completion: int) -> None:
        if last is None:  # closed before any update (client left while queued)
            self.finished.labels(finish_reason="cancelled").inc()
            return
        reason = last.finish_reason or "cancelled"  # closed before the final update: the client went away
        self.finished.labels(finish_reason=reason).inc()
        if reason == "error":
            self.errors.labels(kind="generation").inc()
        self.prompt_tokens.inc(max(0, last.prompt_tokens))
        self.completion_tokens.inc(max(0, completion))
        if first_at is not None and completion >= 2:
            elapsed = time.monotonic() - first_at
            if elapsed > 0:
                self.tokens_per_s.observe((completion - 1) / elapsed)


class _Tally:
    """One stream's metrics while it runs (sync or async alike): active from creation to ``end``, the time to
    its first token, its last update and each choice's completion tokens (n > 1: several choices)."""

    def __init__(self, backend: InstrumentedBackend) -> None:
        self.backend = backend
        self.start = time.monotonic()
        self.first_at: Optional[float] = None
        self.last: Optional[StreamUpdate] = None
        self.completion: dict[int, int] = {}
        self.failed = False
        backend.active.inc()

    def see(self, update: StreamUpdate) -> None:
        if self.first_at is None and (update.reasoning_delta or update.answer_delta or update.completion_tokens):
            self.first_at = time.monotonic()
            self.backend.ttft.observe(update.ttft_s if update.ttft_s is not None else self.first_at - self.start)
        self.last = update
        self.completion[update.index] = update.completion_tokens

    def end(self) -> None:
        self.backend.active.dec()
        if not self.failed:
            self.backend._record_end(self.last, self.first_at, sum(self.completion.values()))


def instrument(backend: ChatBackend, registry: Optional[CollectorRegistry] = None) -> InstrumentedBackend:
    """Wrap ``backend`` so every ``stream_chat`` is counted; returns it unchanged if already instrumented."""
    if isinstance(backend, InstrumentedBackend):
        return backend
    return InstrumentedBackend(backend, registry)


def health_response(backend: ChatBackend) -> JSONResponse:
    """``/healthz`` for ``backend`` as a response: status and body from ``front.health_report`` (200
    ``{"status": "ok", ...}`` when ``backend.health()["ok"]``, else 503 ``{"status": "unavailable", "reason":
    ...}``)."""
    status, body = health_report(backend)
    return JSONResponse(body, status_code=status)


def create_router(backend: ChatBackend) -> APIRouter:
    """``GET /healthz`` and ``GET /metrics`` for ``backend``.

    Pass the object returned by ``instrument`` so ``/metrics`` shows request metrics; for a plain backend
    ``/metrics`` only has the scrape-time gauges (health, ``stats()``).  Both endpoints are unauthenticated
    (they expose no conversation data), like Prometheus targets usually are.
    """
    if isinstance(backend, InstrumentedBackend):
        registry = backend.registry
    else:
        registry = CollectorRegistry()
        registry.register(_BackendCollector(backend))
    router = APIRouter()
    # Own worker threads: health() and stats() may block briefly (locks), and a busy shared thread pool must
    # not make the health check time out.
    limiter = anyio.CapacityLimiter(OPS_THREADS)

    @router.get("/healthz", tags=["ops"])
    async def healthz() -> JSONResponse:
        return await anyio.to_thread.run_sync(health_response, backend, limiter=limiter)

    @router.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        body = await anyio.to_thread.run_sync(generate_latest, registry, limiter=limiter)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
