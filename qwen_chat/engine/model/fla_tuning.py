"""fla's chunked delta-rule kernels with the tile configurations measured on this GPU, instead of autotuning them
at every cold start.

fla autotunes each of its prefill kernels the first time it meets a new tuning key: it compiles every candidate
configuration (12 for ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``) and times them.  On one H200
(2026-12-04, ``bench/results/2026-12-04-NVIDIA-H200-burst-probe.log``, ``TRITON_PRINT_AUTOTUNING=1``) that took
92 s for the five kernels of the packed (varlen) and the single-sequence calls, most of a cold start's warm-up;
Triton's autotuning cache (start.sh) only helps the starts after it.  fla can take the winners from files
instead (``fla.ops.utils.cache``: ``FLA_CONFIG_DIR``/``{kernel}.json``, looked up by the tuning key when
``FLA_CACHE_MODE`` is ``fuzzy``: the same key structure and dtypes, any sizes); ``bench/fla_configs.py``
writes such files from a ``TRITON_PRINT_AUTOTUNING`` log.  They live in ``fla_configs/<GPU name>/`` with a
``manifest.json`` naming the fla and Triton versions they were measured with; ``use_measured_configs`` points
fla at them when the GPU, fla and Triton match, and leaves fla's own autotuning otherwise (another GPU's tiles
may not fit its shared memory).  Setting ``FLA_CACHE_MODE`` yourself turns this off.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

#: One folder per GPU name as fla spells it (``cache.sanitize_gpu_name``), e.g. ``NVIDIA_H200``.
CONFIG_ROOT = Path(__file__).with_name("fla_configs")


def _versions() -> dict[str, str]:
    import fla
    import triton

    return {"fla": str(getattr(fla, "__version__", "?")), "triton": str(triton.__version__)}


def use_measured_configs(device: torch.device) -> Optional[str]:
    """Point fla's kernel-config lookup at ``CONFIG_ROOT/<this GPU>/`` (process-wide) when that folder exists
    and its manifest's versions are the installed ones.  Returns a phrase for the start-up log (what was
    chosen, or why not), or None when fla is not installed or ``device`` is not CUDA."""
    if device.type != "cuda":
        return None
    try:
        from fla.ops.utils import cache
    except ImportError:
        return None
    if "FLA_CACHE_MODE" in os.environ:
        return f"fla kernel configs: as FLA_CACHE_MODE={os.environ['FLA_CACHE_MODE']} says"
    name = cache.sanitize_gpu_name(torch.cuda.get_device_name(device))
    folder = CONFIG_ROOT / name
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return f"fla kernel configs: autotuned on first use (none measured for {name})"
    wanted = json.loads(manifest.read_text())["versions"]
    have = _versions()
    if any(have.get(k) != v for k, v in wanted.items()):
        return f"fla kernel configs: autotuned on first use (measured with {wanted}, installed {have})"
    os.environ.setdefault("FLA_CONFIG_DIR", str(folder))  # fla reads it at every lookup
    cache.FLA_CACHE_MODE = cache.FlaCacheMode.FUZZY       # fla read FLA_CACHE_MODE when it was imported
    return f"fla kernel configs: measured on {name} ({os.environ['FLA_CONFIG_DIR']})"
