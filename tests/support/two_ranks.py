"""Run a test body on two local ranks (``torch.multiprocessing.spawn``) and collect what each rank reports.

``run_two_ranks(body, tmp_path, backend)`` starts 2 processes, initialises ``torch.distributed`` with ``backend``
("gloo" on CPU, "nccl" with one GPU per rank) through a FileStore in ``tmp_path``, calls ``body(rank, report)``
(a module-level function, so it can be pickled; it fills the dict ``report``), and returns both ranks' reports.
An exception in ``body`` is recorded in ``report["errors"]`` instead of failing the process.  Each rank ends as the
service's processes do (``lifecycle.leave``: atexit handlers, streams flushed, ``os._exit``), skipping the
interpreter's teardown: there a gloo or DeepSpeed helper thread destroyed while still joinable aborted a rank that
had already written its report ("terminate called without an active exception", SIGABRT, seen once in CI).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


def _entry(rank: int, body: Callable, backend: str, store_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    kwargs = {}
    if backend == "nccl":
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, 2), rank=rank, world_size=2, **kwargs)
    report: dict = {"rank": rank, "errors": []}
    try:
        body(rank, report)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        if backend == "nccl":
            torch.cuda.synchronize()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
    from qwen_chat.lifecycle import leave

    leave(0)


def run_two_ranks(body: Callable, tmp_path: Path, backend: str) -> list[dict]:
    """Both ranks' reports (list of 2 dicts), after both processes ended."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(body, backend, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
