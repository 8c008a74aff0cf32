"""Fast checks of the sharding configuration, rank discovery and self-check comparison (no processes started)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen_chat.engine.parallel import executors
from qwen_chat.engine.parallel import ranks as qdist
from qwen_chat.engine.startup.selfcheck import compare_self_checks
from qwen_chat.engine.parallel.sharding import ShardingError, check_tp_degree, read_plan
from qwen_chat.engine.parallel.tp_layers import GatheredColumnLinear, VocabParallelEmbedding

ROOT = Path(__file__).resolve().parents[2]
QWEN35_9B_TEXT = SimpleNamespace(num_key_value_heads=4, num_attention_heads=16, linear_num_key_heads=16,
                                 linear_num_value_heads=32)


def test_shipped_tp_config_follows_the_world_size():
    plan = read_plan(ROOT / "ds_config.json", 2, "cuda")
    assert (plan.mode, plan.tp_size, plan.dtype) == ("tp", 2, torch.bfloat16)
    assert plan.ds_config["tensor_parallel"]["autotp_size"] == 2
    assert plan.ds_config["zero_optimization"]["stage"] == 0
    assert read_plan(ROOT / "ds_config.json", 4, "cuda").tp_size == 4
    single = read_plan(ROOT / "ds_config.json", 1, "cuda")
    assert single.mode == "single" and not single.uses_deepspeed


def test_cpu_ranks_use_fp32_and_drop_offload():
    plan = read_plan(ROOT / "deploy" / "ds_config.zero3-offload.json", 2, "cpu")
    assert plan.dtype == torch.float32 and plan.ds_config["bf16"] == {"enabled": False}
    assert "offload_param" not in plan.ds_config["zero_optimization"]
    gpu = read_plan(ROOT / "deploy" / "ds_config.zero3-offload.json", 2, "cuda")
    assert gpu.mode == "zero3-offload" and gpu.is_zero3
    assert gpu.ds_config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_zero3_keeps_small_tensors_resident():
    plan = read_plan(ROOT / "deploy" / "ds_config.zero3.json", 2, "cuda")
    assert plan.mode == "zero3"
    # the largest small tensor the runner reads directly: a Gated DeltaNet conv1d, 8192 channels x 4
    assert plan.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] >= 8192 * 4


def test_no_config_is_single_process_or_tp_over_all_ranks():
    assert read_plan(None, 1, "cuda").mode == "single"
    plan = read_plan(None, 4, "cuda")
    assert (plan.mode, plan.tp_size) == ("tp", 4)


def test_tp_degree_must_equal_the_world_size(tmp_path):
    cfg = tmp_path / "tp2.json"
    cfg.write_text(json.dumps({"tensor_parallel": {"autotp_size": 2}}))
    with pytest.raises(ShardingError, match="autotp_size is 2 but the launcher started 4 ranks"):
        read_plan(cfg, 4, "cuda")


def test_unusable_configs_are_rejected_with_a_message(tmp_path):
    stage2 = tmp_path / "z2.json"
    stage2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ShardingError, match="stage 2 is not an inference mode"):
        read_plan(stage2, 2, "cuda")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ShardingError, match="cannot read DeepSpeed config"):
        read_plan(broken, 2, "cuda")
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}))
    with pytest.raises(ShardingError, match="either ZeRO-3 or tensor_parallel"):
        read_plan(both, 2, "cuda")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_degrees_that_divide_the_kv_heads_are_accepted(tp):
    check_tp_degree(QWEN35_9B_TEXT, tp)


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_degree_that_does_not_divide_the_heads_is_a_clear_error(tp):
    with pytest.raises(ShardingError) as err:
        check_tp_degree(QWEN35_9B_TEXT, tp)
    text = str(err.value)
    assert f"tensor parallel degree {tp} does not divide num_key_value_heads = 4" in text
    assert "[1, 2, 4]" in text


def test_vocab_parallel_embedding_rows_cover_the_table_exactly():
    torch.manual_seed(0)
    full = torch.nn.Embedding(11, 5)
    ids = torch.tensor([[0, 5, 6, 10], [3, 7, 1, 9]])
    parts = [VocabParallelEmbedding(full, r, 2) for r in range(2)]
    assert [(p.start, p.end) for p in parts] == [(0, 6), (6, 11)]
    # without a process group the all-reduce is skipped: the sum over ranks is what the all-reduce computes
    total = sum(p(ids) for p in parts)
    assert torch.equal(total, full(ids))
    assert torch.count_nonzero(parts[0](ids)[0, 2]) == 0  # id 6 belongs to rank 1


def test_gathered_column_linear_slices_concatenate_to_the_full_output():
    torch.manual_seed(0)
    full = torch.nn.Linear(6, 8, bias=False)
    x = torch.randn(3, 6)
    parts = [GatheredColumnLinear(full, r, 2) for r in range(2)]
    assert [p.weight_rows.shape for p in parts] == [torch.Size([4, 6])] * 2
    # without a process group each part returns its own 4 outputs; the all-gather concatenates them in rank order
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), full(x), rtol=0, atol=1e-6)


def test_rank_info_from_launcher_environment():
    info = qdist.RankInfo.from_env({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert (info.rank, info.local_rank, info.world_size, info.is_main) == (1, 1, 2, False)
    alone = qdist.RankInfo.from_env({})
    assert (alone.rank, alone.world_size, alone.is_main) == (0, 1, True)
    assert qdist.RankInfo.from_env({"RANK": "0", "WORLD_SIZE": "2"}, local_rank_arg=0).local_rank == 0
    with pytest.raises(ValueError, match="inconsistent launcher environment"):
        qdist.RankInfo.from_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_heartbeat_fits_several_pings_into_one_timeout():
    assert executors.heartbeat_interval(2.0) == 0.5
    assert executors.heartbeat_interval(7 * 24 * 3600) == executors.MAX_HEARTBEAT_S


def test_self_check_comparison_names_the_rank_that_differs():
    same = {"tokens": [5, 6, 7], "checksum": 12.5}
    assert compare_self_checks([same, dict(same)]) is None
    off = compare_self_checks([same, same, {"tokens": [5, 6, 8], "checksum": 12.5}])
    assert off is not None and off.startswith("rank 2 disagrees with rank 0")
    assert compare_self_checks([same, {"tokens": [5, 6, 7], "checksum": 13.0}]) is not None
