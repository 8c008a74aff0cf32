"""Programmatic dependent launch (PDL) for the decode step's kernels (NVIDIA Hopper, compute capability >= 9.0).

Without it, a kernel in a stream starts only after the one before it has finished and flushed its writes, so a
batch-1 decode step (about 300 small kernels, CUDA graph replays included) pays each kernel's launch, the ramp-up
of its first loads and the drain of its last wave in turn.  With PDL a kernel launched with the
programmatic-stream-serialization attribute may start while the previous one still runs; it must execute
``griddepcontrol.wait`` (Triton: ``tl.extra.cuda.gdc_wait``) before it touches anything the previous kernels
write, which waits for them to complete and their memory to be visible; ``griddepcontrol.launch_dependents``
(``gdc_launch_dependents``) lets the next kernel launch early.  Both instructions are no-ops in a kernel
launched without the attribute.  Sources: CUDA C++ Programming Guide, "Programmatic Dependent Launch and
Synchronization"; PTX ISA, "griddepcontrol"; Triton's tutorial ``11-programmatic-dependent-launch.py``.

The engine's Triton kernels (``gemv``, ``fp8_gemv``, ``gdn``) take a ``PDL`` constexpr: when it is set they
load what the step never writes (weight tiles and their scales) first, then call ``wait_then_release`` before
their first load of an activation or state and before any store.  Every such kernel waits before it lets its
successor launch, so when a kernel starts, every kernel two or more places before it has completed.  The glue
compiled by Inductor gets the same treatment from Inductor itself (``inductor_options``: its
``triton.enable_pdl`` switch).

The switch is process-wide (``set_enabled``; the runner sets it from ``RunnerOptions.pdl``), because the
kernels are reached through ``fp8.linear`` from many places; ``launch_options`` is what each launch passes.
PDL changes when kernels start, never what they compute: the step's logits are the same bits either way
(checked on the GPU by ``bench/pdl_probe.py`` and ``tests/gpu``).
"""
from __future__ import annotations

import functools

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU hosts never enable PDL.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the host
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # pragma: no cover - a Triton before 3.3: no PDL, the kernels still run
    gdc_wait = gdc_launch_dependents = None

_enabled = False


if triton is not None and gdc_wait is not None:

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """With PDL: wait until the previous kernels completed (their writes visible), then let the next kernel
        launch.  Call after the loads of constants (weights) and before any other load or store."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

elif triton is not None:  # pragma: no cover - a Triton before 3.3

    @triton.jit
    def wait_then_release(PDL: tl.constexpr):
        """Without grid-dependency control in this Triton: nothing (``supported`` is false)."""
        pass


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def supported(device: torch.device) -> bool:
    """True when kernels on ``device`` can be launched with PDL: a CUDA device of compute capability >= 9.0 and a
    Triton with ``tl.extra.cuda.gdc_wait`` (3.3 and newer)."""
    device = torch.device(device)
    if triton is None or gdc_wait is None or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def set_enabled(flag: bool) -> None:
    """Turn PDL on or off for the kernels launched from now on (and for graphs captured from now on).
    Raises ValueError when turning it on without Triton's grid-dependency control."""
    global _enabled
    if flag and (triton is None or gdc_wait is None):
        raise ValueError("programmatic dependent launch needs Triton with tl.extra.cuda.gdc_wait")
    _enabled = bool(flag)


def enabled() -> bool:
    """Whether the engine's Triton kernels are launched with PDL now."""
    return _enabled


def launch_options() -> dict:
    """Keyword arguments of one kernel launch: ``PDL`` (the kernels' constexpr) and, when on, Triton's
    ``launch_pdl`` launch flag."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}


def inductor_options(flag: bool) -> dict:
    """``torch.compile`` options for the compiled glue: Inductor's own PDL switch (``triton.enable_pdl``) when
    ``flag`` is set and this PyTorch has it, else nothing."""
    try:
        from torch._inductor import config
    except Exception:  # pragma: no cover - depends on the host
        return {}
    return {"triton.enable_pdl": True} if flag and hasattr(config.triton, "enable_pdl") else {}
