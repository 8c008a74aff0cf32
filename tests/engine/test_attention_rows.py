"""The decode attention in row groups (``glue.in_row_groups``, ``memory.attention_rows``): every row's output is
the one call's, for a bf16 and an FP8 cache, and the memory plan keeps for the scores what one group takes, so
a large budget's KV cache holds the tokens the reserve no longer takes."""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.model import glue, kv_quant, memory
from qwen_chat.engine.model.state import Geometry

NKV, GROUP, HD, BT = 2, 2, 32, 16


def attention_inputs(rows: int, blocks: int, kv_dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        x = torch.randn(blocks, BT, NKV, HD, generator=gen)
        caches.append((x, None) if kv_dtype is None else kv_quant.quantize(x))
    q = torch.randn(rows, NKV, GROUP, HD, generator=gen)
    table = torch.stack([torch.randperm(blocks, generator=gen) for _ in range(rows)])
    pos = torch.randint(0, blocks * BT, (rows,), generator=gen)
    (kc, ks), (vc, vs) = caches
    return q, kc, vc, table, pos, HD ** -0.5, ks, vs


def test_attention_rows_keep_the_scores_within_the_cap_and_take_at_least_one_row():
    heads = 16  # Qwen3.5-9B on one GPU (docs/facts.md)
    assert memory.attention_rows(heads, 131072) == memory.SCORES_BYTES_MAX // (8 * heads * 131072) == 16
    assert memory.attention_rows(heads, 4096) == 512
    assert memory.attention_rows(heads, 10 ** 9) == 1
    for slots, ctx in ((128, 262144), (128, 4096), (3, 131072)):
        reserve = memory.scores_reserve(slots, heads, ctx)
        assert reserve == 8 * heads * ctx * min(slots, memory.attention_rows(heads, ctx))
        assert reserve <= max(memory.SCORES_BYTES_MAX, 8 * heads * ctx)


@pytest.mark.parametrize("kv_dtype", [None, kv_quant.FP8], ids=["fp32", "fp8"])
def test_row_groups_give_every_row_the_output_of_one_call(monkeypatch, kv_dtype):
    args = attention_inputs(rows=7, blocks=6, kv_dtype=kv_dtype)
    whole = glue.attn_core(*args)
    ctx = 6 * BT
    monkeypatch.setattr(memory, "SCORES_BYTES_MAX", 3 * 8 * NKV * GROUP * ctx)   # groups of 3, 3 and 1 rows
    assert memory.attention_rows(NKV * GROUP, ctx) == 3
    calls = []

    def core(q, *rest):
        calls.append(q.shape[0])
        return glue.attn_core(q, *rest)

    grouped = glue.in_row_groups(core)(*args)
    assert calls == [3, 3, 1]
    assert grouped.shape == whole.shape == (7, NKV, GROUP, HD)
    torch.testing.assert_close(grouped, whole, rtol=1e-6, atol=1e-6)
    assert glue.glue_functions(False)["attn_core"](*args).shape == whole.shape
    start = args[4] // 2  # each group gets its own rows' context starts (the MTP layer's)
    torch.testing.assert_close(glue.in_row_groups(core)(*args, start), glue.attn_core(*args, start),
                               rtol=1e-6, atol=1e-6)


def test_the_plan_keeps_one_row_group_of_scores_and_gives_the_rest_to_the_kv_cache():
    """Qwen3.5-9B's geometry at the budget of the 24 GB cap with FP8 weights (8.49 GiB measured on an H200,
    bench/results/2026-12-04-NVIDIA-H200-fp8kv.json): 87 slots.  Scores for every slot at the top bucket took
    more than the FP8 KV cache itself; one group of rows takes at most SCORES_BYTES_MAX."""
    linear = dict(dk=128, dv=128, K=4, conv_dim=8192, key_dim=2048, value_dim=4096, nk=16, nv=32)
    full = dict(hd=256, nq=16, nkv=4, groups=4, scale=256 ** -0.5)
    kinds = ("linear", "linear", "linear", "full") * 8
    geo = tuple(dict(linear) if k == "linear" else dict(full) for k in kinds)
    budget = int(8.491 * 2 ** 30)
    for kv, at_least in ((None, 110_000), (kv_quant.FP8, 180_000)):
        g = Geometry(kinds, geo, torch.bfloat16, kv)
        plan = memory.plan_memory(g, budget_bytes=budget, model_context=262144)
        assert plan.num_slots == 87 and plan.kv_tokens >= at_least
        scores = plan.scores_bytes - g.layer_kv_token_bytes() * plan.max_context
        assert 0 < scores <= memory.SCORES_BYTES_MAX
        used = plan.num_slots * plan.slot_bytes + plan.kv_tokens * plan.kv_token_bytes + plan.scores_bytes
        assert budget - 2 * plan.block_tokens * plan.kv_token_bytes <= used <= budget   # less than 2 blocks unused
