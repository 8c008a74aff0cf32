"""Where start-up's compilation time goes: Triton JIT compiles and TorchDynamo / Inductor graphs, per phase.

A cold start spends most of its time compiling (decode graphs, prefill graphs, the sampler, the warm-up), and a
start with the compile caches on disk mostly loads.  ``CompileTally`` counts both kinds so that the start-up
log says, for each phase, how many kernels were compiled or found in a cache and how long compiling took:

- Triton kernels compiled in this process (the engine's own kernels, fla's, the Triton interpreter excluded):
  ``triton.knobs.compilation.listener`` (Triton >= 3.4) is called once per ``triton.compile`` with the
  compiler's own stage timings (``CompileTimes``, microseconds) and whether the result came from Triton's cache.
  Autotuning's benchmark runs are not compilation and are not counted.
- Graphs compiled by ``torch.compile``: ``torch._dynamo.utils.compilation_time_metrics["_compile.compile_inner"]``
  holds one duration (seconds) per compiled frame, Inductor's code generation and its Triton kernels (compiled
  in worker processes, not seen by the listener above) included.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mark:
    """A point in start-up to measure from (``CompileTally.mark``)."""

    wall: float
    triton_compiled: int
    triton_cached: int
    triton_s: float
    graphs: int
    graphs_s: float
    per_kernel: dict  # kernel name -> compiles so far


def _dynamo_metrics() -> dict:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without it: graphs are not counted
        return {}
    return compilation_time_metrics


def _dynamo_times() -> list[float]:
    return list(_dynamo_metrics().get("_compile.compile_inner", ()))


def torch_compile_steps(n: int = 8) -> str:
    """The ``n`` steps of ``torch.compile`` that took longest in this process, from TorchDynamo's own timers
    (``torch._dynamo.utils.compilation_time_metrics``: function name -> durations in seconds; nested steps
    overlap their callers, e.g. ``GraphLowering.compile_to_module`` inside ``_compile.compile_inner``; Inductor's
    autotuning of a kernel at its first run is ``CachingAutotuner.benchmark_all_configs``): ``"name xcount
    seconds s, ..."``, or ``"none"``."""
    totals = [(name, len(times), sum(times)) for name, times in _dynamo_metrics().items() if times]
    ranked = sorted(totals, key=lambda t: -t[2])[:n]
    return ", ".join(f"{name} x{count} {secs:.1f} s" for name, count, secs in ranked) or "none"


class CompileTally:
    """Counts compilations from ``install()`` on (one per process: ``shared()``).

    ``mark()`` returns a ``Mark``; ``describe(mark)`` says what was compiled since it, in one phrase for the
    start-up log; ``compiled_since(mark)`` names the kernels; ``top(n)`` names the Triton kernels that took longest to compile in total.
    """

    def __init__(self):
        self.compiled = 0
        self.cached = 0
        self.seconds = 0.0
        self.per_kernel: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        self._installed = False

    def install(self) -> "CompileTally":
        """Chain this tally's listener in front of any listener already set.  Without Triton (or a Triton
        older than 3.4, which has no listener) it counts nothing and says so in ``describe``."""
        if self._installed:
            return self
        try:
            from triton import knobs
        except ImportError:
            return self
        if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
            return self
        previous = knobs.compilation.listener

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            self._record(str(metadata.get("name", "?")), cache_hit, times.total / 1e6)
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                         cache_hit=cache_hit)

        knobs.compilation.listener = listener
        self._installed = True
        return self

    def _record(self, name: str, cache_hit: bool, seconds: float) -> None:
        if cache_hit:
            self.cached += 1
            return
        self.compiled += 1
        self.seconds += seconds
        entry = self.per_kernel[name]
        entry[0] += 1
        entry[1] += seconds

    def mark(self) -> Mark:
        graphs = _dynamo_times()
        return Mark(time.monotonic(), self.compiled, self.cached, self.seconds, len(graphs), sum(graphs),
                    {name: count for name, (count, _) in self.per_kernel.items()})

    def compiled_since(self, since: Mark) -> dict[str, int]:
        """The Triton kernels compiled since ``since``: name -> how many times."""
        return {name: count - since.per_kernel.get(name, 0) for name, (count, _) in self.per_kernel.items()
                if count > since.per_kernel.get(name, 0)}

    def describe(self, since: Mark) -> str:
        """E.g. ``"12.3 s: 40 Triton kernels compiled (31.0 s of compiling), 5 from cache; 7 torch.compile
        graphs (20.1 s)"`` for the time since ``since`` (compiling may overlap: Inductor compiles in workers)."""
        now = self.mark()
        if not self._installed:
            triton = "Triton compiles not counted (no compilation listener)"
        else:
            triton = (f"{now.triton_compiled - since.triton_compiled} Triton kernels compiled "
                      f"({now.triton_s - since.triton_s:.1f} s), {now.triton_cached - since.triton_cached} from cache")
        return (f"{now.wall - since.wall:.1f} s: {triton}; {now.graphs - since.graphs} torch.compile graphs "
                f"({now.graphs_s - since.graphs_s:.1f} s)")

    def top(self, n: int = 6) -> str:
        """The ``n`` Triton kernels with the most compile time: ``"name xcount (seconds s), ..."``."""
        ranked = sorted(self.per_kernel.items(), key=lambda kv: -kv[1][1])[:n]
        return ", ".join(f"{name} x{count} ({secs:.1f} s)" for name, (count, secs) in ranked) or "none"


_SHARED = CompileTally()


def shared() -> CompileTally:
    """The process's tally, its listener installed on first use."""
    return _SHARED.install()
