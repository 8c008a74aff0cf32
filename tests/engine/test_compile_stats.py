"""The start-up log's compile counts (``startup.compile_stats``): Triton compiles through Triton's own
compilation listener, ``torch.compile`` graphs through TorchDynamo's compile-time metrics."""
import pytest
import torch

from qwen_chat.engine.startup import compile_stats
from qwen_chat.engine.startup.compile_stats import CompileTally

knobs = pytest.importorskip("triton.knobs")


class _Times:
    """Triton's ``CompileTimes`` as the listener receives it (only ``total`` is read; microseconds)."""

    def __init__(self, micros: int):
        self.total = micros


@pytest.fixture
def restore_listener():
    before = knobs.compilation.listener
    yield
    knobs.compilation.listener = before


def _compile_event(name: str, seconds: float, cache_hit: bool) -> None:
    knobs.compilation.listener(src=None, metadata={"name": name}, metadata_group={},
                               times=_Times(int(seconds * 1e6)), cache_hit=cache_hit)


def test_triton_compiles_counted_per_phase_and_cache_hits_apart(restore_listener):
    seen = []
    knobs.compilation.listener = lambda **kw: seen.append(kw["metadata"]["name"])  # a listener set before ours
    tally = CompileTally().install()
    first = tally.mark()
    _compile_event("gemv", 1.5, cache_hit=False)
    _compile_event("gemv", 0.5, cache_hit=False)
    second = tally.mark()
    _compile_event("conv", 3.0, cache_hit=False)
    _compile_event("gemv", 0.0, cache_hit=True)
    assert "3 Triton kernels compiled (5.0 s), 1 from cache" in tally.describe(first)
    assert "1 Triton kernels compiled (3.0 s), 1 from cache" in tally.describe(second)
    assert tally.top(2) == "conv x1 (3.0 s), gemv x2 (2.0 s)"
    assert tally.compiled_since(first) == {"gemv": 2, "conv": 1} and tally.compiled_since(second) == {"conv": 1}
    assert seen == ["gemv", "gemv", "conv", "gemv"]  # the earlier listener still hears every compile


def test_torch_compile_graphs_counted(restore_listener):
    tally = CompileTally().install()
    mark = tally.mark()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))
    assert "1 torch.compile graphs" in tally.describe(mark)
    assert "0 Triton kernels compiled" in tally.describe(mark)
    steps = compile_stats.torch_compile_steps(50)
    assert "_compile.compile_inner x" in steps  # TorchDynamo's own timer of the graph just compiled
    secs = [float(part.rsplit(" ", 2)[-2]) for part in steps.split(", ")]
    assert secs == sorted(secs, reverse=True)  # slowest first
