"""Shared pytest fixtures (owner: assets).

- ``tiny_checkpoint``: Path of the built-in tiny Qwen3.5 checkpoint, built once per test session into a
  temporary cache folder, or reused from ``$QWEN_CHAT_CACHE_DIR`` when that is set (saves ~20 s per run).
- ``tiny_loaded``: the ``LoadedModel`` of that checkpoint on CPU in fp32 (shared: do not modify its weights).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from qwen_chat.engine.checkpoints.tiny import build_tiny_checkpoint

    cache = os.environ.get("QWEN_CHAT_CACHE_DIR")
    cache_dir = Path(cache) if cache else tmp_path_factory.mktemp("qwen_chat_cache")
    return build_tiny_checkpoint(cache_dir)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_checkpoint):
    import torch

    from qwen_chat.engine.checkpoints.loading import load_model

    return load_model(tiny_checkpoint, "cpu", torch.float32)
