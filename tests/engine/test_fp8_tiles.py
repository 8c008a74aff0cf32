"""The FP8 GEMV's launch tiles (qwen_chat.engine.model.fp8_gemv): the measured tiles file, ``pick_config`` and
the refusal of a tile that cannot launch."""
from __future__ import annotations

import json

import pytest
import torch

from qwen_chat.engine.model.fp8 import quantize_blocks


def test_measured_tiles_launch_and_bad_tiles_are_refused(tmp_path, monkeypatch):
    """The FP8 GEMV's launch tiles: every entry of the measured tiles file can launch for its batch class (a
    broken entry would fail at the first decode step on a GPU), a file entry is what ``pick_config`` returns, and
    ``gemv_fp8`` refuses a tile that cannot launch with a ValueError naming it."""
    from qwen_chat.engine.model import fp8_gemv

    doc = json.loads(fp8_gemv.TILES_FILE.read_text()) if fp8_gemv.TILES_FILE.exists() else {"tiles": {}}
    for key, cfg in doc["tiles"].items():
        cls, n, k = key.split(":")
        assert cls in ("1", "16", "32", "64") and int(k) % 128 == 0, key
        assert fp8_gemv.valid_config(cfg, int(cls), int(k)), (key, cfg)
    for B in (1, 2, 16, 17, 33, 64):
        for N, K in ((12288, 4096), (4096, 12288), (200, 256)):
            assert fp8_gemv.valid_config(fp8_gemv.pick_config(B, N, K), B, K), (B, N, K)
    tiles = tmp_path / "tiles.json"
    tiles.write_text(json.dumps({"tiles": {"1:384:256": {"BLOCK_B": 16, "BLOCK_N": 64, "num_warps": 4,
                                                         "num_stages": 4},
                                           "16:384:256": {"BLOCK_N": 8, "BLOCK_K": 256}}}))
    monkeypatch.setattr(fp8_gemv, "TILES_FILE", tiles)
    fp8_gemv.tuned.cache_clear()
    try:
        assert fp8_gemv.pick_config(1, 384, 256) == {"BLOCK_B": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
        assert "BLOCK_B" in fp8_gemv.pick_config(4, 384, 256)  # a row tile for 2-16 rows is ignored
    finally:
        fp8_gemv.tuned.cache_clear()
    q = quantize_blocks(torch.randn(384, 256))
    x = torch.randn(1, 256)
    monkeypatch.setattr(fp8_gemv, "supports", lambda *a, **k: True)  # CPU: the operand check would come first
    for bad in (dict(BLOCK_N=3, BLOCK_K=256), dict(BLOCK_N=8, BLOCK_K=384), dict(BLOCK_B=8, BLOCK_N=32),
                dict(BLOCK_B=16, BLOCK_N=256)):
        with pytest.raises(ValueError, match="cannot launch"):
            fp8_gemv.gemv_fp8(x, q.data, q.scale, config=bad)
