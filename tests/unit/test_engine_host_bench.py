"""``bench/engine_host_bench.py`` on the tiny model: the real engine core with the synthetic executor delivers
every requested token of every stream through the real link, and the record says what it measured."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_stream_gets_its_tokens_and_the_cost_is_recorded(tmp_path, tiny_checkpoint):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import engine_host_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    out = tmp_path / "engine.json"
    code = engine_host_bench.main(["--streams", "3", "5", "--tokens", "7", "--prompt-tokens", "40", "--repeat", "1",
                                   "--step-ms", "2", "--cache-dir", str(tiny_checkpoint.parent), "--out", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    for streams in (3, 5):
        burst = doc["bursts"][str(streams)]
        assert burst["tokens"] == streams * 7                # every stream ran to max_tokens, nothing lost
        assert burst["steps"] >= 7                            # a prefill step, then one decode step per token
        assert burst["engine_us_per_token"] >= 0 and burst["wall_s"] >= 6 * 0.002  # CPU clock: 10 ms ticks
    assert doc["step_ms"] == 2.0 and doc["prompt_tokens"] == 40
