"""fla's prefill kernels take the tile configurations measured on the GPU (``model.fla_tuning``) instead of
autotuning at every cold start: the files are in fla's format and reproducible from the recorded autotuning
log, and they are used only on the GPU, fla and Triton they were measured with."""
import enum
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from qwen_chat.engine.model import fla_tuning

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import fla_configs  # noqa: E402

H200 = fla_tuning.CONFIG_ROOT / "NVIDIA_H200"


def test_files_are_in_flas_format_and_come_from_the_recorded_log():
    manifest = json.loads((H200 / "manifest.json").read_text())
    assert manifest["versions"] == {"fla": "0.6.0", "triton": "3.6.0"}
    from_log = fla_configs.parse_log((ROOT / manifest["source"]).read_text().splitlines())
    files = {p.stem: json.loads(p.read_text()) for p in H200.glob("*.json") if p.name != "manifest.json"}
    assert set(files) == set(from_log) == {
        "chunk_local_cumsum_scalar_kernel", "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
        "recompute_w_u_fwd_kernel", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_fwd_kernel_o"}
    for name, doc in files.items():
        assert doc["kernel_name"] == name and doc["autotune_entries"] == from_log[name]
        for digest, entry in doc["autotune_entries"].items():
            assert digest == fla_configs.key_hash(entry["autotune_key"])  # fla's exact lookup finds it
            cfg = entry["config"]
            assert isinstance(cfg["kwargs"], dict) and cfg["num_warps"] in (1, 2, 4, 8)
            assert cfg["num_stages"] >= 1 and cfg["num_ctas"] == 1
    # the packed (varlen) prefill's key of the state kernel, as the H200 printed it
    varlen = [e for e in files["chunk_gated_delta_rule_fwd_kernel_h_blockdim64"]["autotune_entries"].values()
              if "torch.int64" in e["autotune_key"]]
    assert [e["config"] for e in varlen] == [{"kwargs": {"BV": 64}, "num_warps": 4, "num_ctas": 1,
                                              "num_stages": 2, "maxnreg": None}]


def test_parse_config_line():
    assert fla_configs.parse_config("BK: 64, BV: 32, num_warps: 4, num_ctas: 1, num_stages: 3, maxnreg: None") == {
        "kwargs": {"BK": 64, "BV": 32}, "num_warps": 4, "num_ctas": 1, "num_stages": 3, "maxnreg": None}


class _Mode(enum.Enum):
    DISABLED = "disabled"
    FUZZY = "fuzzy"


@pytest.fixture
def fake_fla(monkeypatch):
    """``fla.ops.utils.cache`` as far as ``use_measured_configs`` touches it (fla is installed on CUDA hosts
    only), an H200, and the versions the H200 files were measured with."""
    cache = types.ModuleType("fla.ops.utils.cache")
    cache.FlaCacheMode = _Mode
    cache.FLA_CACHE_MODE = _Mode.DISABLED
    cache.sanitize_gpu_name = lambda name: name.replace(" ", "_")
    for name in ("fla", "fla.ops", "fla.ops.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", cache)
    sys.modules["fla.ops.utils"].cache = cache
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(fla_tuning, "_versions", lambda: {"fla": "0.6.0", "triton": "3.6.0"})
    for name in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR"):  # absent, and restored afterwards (set first: recorded)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return cache


def test_used_on_the_gpu_and_versions_measured(fake_fla):
    said = fla_tuning.use_measured_configs(torch.device("cuda", 0))
    assert fake_fla.FLA_CACHE_MODE is _Mode.FUZZY
    assert Path(os.environ["FLA_CONFIG_DIR"]) == H200
    assert "measured on NVIDIA_H200" in said


def test_not_used_elsewhere(fake_fla, monkeypatch):
    assert fla_tuning.use_measured_configs(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    assert "none measured for NVIDIA_GeForce_RTX_4090" in fla_tuning.use_measured_configs(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(fla_tuning, "_versions", lambda: {"fla": "0.7.0", "triton": "3.6.0"})
    assert "autotuned on first use (measured with" in fla_tuning.use_measured_configs(torch.device("cuda"))
    assert fake_fla.FLA_CACHE_MODE is _Mode.DISABLED


def test_an_explicit_fla_cache_mode_wins(fake_fla, monkeypatch):
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert "FLA_CACHE_MODE=disabled" in fla_tuning.use_measured_configs(torch.device("cuda"))
    assert fake_fla.FLA_CACHE_MODE is _Mode.DISABLED
