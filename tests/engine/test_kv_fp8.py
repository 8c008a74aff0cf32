"""``--kv-cache-dtype fp8`` on the built-in tiny model (fp32 compute, CPU): the round trip's error bound, the
teacher-forced logits against a full-precision cache, the same attention whether a prompt is prefilled in one
chunk or several or continued from a kept prefix, the memory plan's price of a token, and the engine serving it
(a conversation-cache hit equal to a fresh prefill)."""
from __future__ import annotations

import functools

import pytest
import torch

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings
from qwen_chat.engine.core.chat_engine import ChatEngine
from qwen_chat.engine.model import kv_quant
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.types import PrefillItem, PreparedPrompt

FP8 = kv_quant.FP8


def test_a_round_trip_keeps_each_element_within_e4m3_rounding_of_its_head():
    """Each element comes back within 2^-4 of itself (3 mantissa bits, round to nearest) or 2^-9 of its head's
    scale (the subnormals near zero); an all-zero head stays zero; the largest element of a head is 448 x scale."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 256, generator=gen) * torch.logspace(-4, 3, 64)[:, None, None]
    x[3, 2] = 0.0
    q, scale = kv_quant.quantize(x)
    assert q.dtype == FP8 and scale.shape == (64, 4) and scale.dtype == torch.float32
    back = kv_quant.dequantize(q, scale, torch.float32)
    bound = x.abs() * 2 ** -4 + scale[..., None] * 2 ** -9
    assert (back - x).abs().le(bound * 1.0001).all()
    assert back[3, 2].eq(0).all()
    assert torch.allclose(q.float().abs().amax(-1)[scale > kv_quant.MIN_SCALE], torch.tensor(448.0))


def runner(loaded, kv_dtype=None, num_blocks=None):
    return ModelRunner(loaded.model, num_slots=3, max_context=256, num_blocks=num_blocks, device="cpu",
                       kv_dtype=kv_dtype, block_tokens=16)


def prompt(n=60, seed=0):
    return PreparedPrompt(input_ids=torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(seed)))


def teacher_forced(r, p, chunks, tokens):
    """Logits [1 + len(tokens), V]: the prompt's last (prefilled in ``chunks``), then one per fed token."""
    start, out = 0, None
    for c in chunks:
        out = r.prefill_batch([PrefillItem(0, p, start=start, end=start + c)])
        start += c
    rows = [out.reshape(-1)]
    for t in tokens:
        rows.append(r.decode([0], torch.tensor([t]))[0])
    return torch.stack(rows)


def rel(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


def test_fp8_kv_logits_stay_close_to_a_full_precision_cache_teacher_forced(tiny_loaded):
    """60 prompt tokens then 32 fed tokens (the full-precision run's greedy ones): every step's logits within
    3 % (relative L2) of the fp32 cache's; the caches hold FP8 and fp32 scales, half the bytes or less."""
    p = prompt()
    ref_runner = runner(tiny_loaded)
    rows = [ref_runner.prefill_batch([PrefillItem(0, p, start=0, end=60)]).reshape(-1)]
    tokens = []
    for _ in range(32):
        tokens.append(int(rows[-1].argmax()))
        rows.append(ref_runner.decode([0], torch.tensor([tokens[-1]]))[0])
    ref = torch.stack(rows)
    fp8_runner = runner(tiny_loaded, FP8)
    got = teacher_forced(fp8_runner, p, [60], tokens)
    err = rel(got, ref)
    assert 0 < err < 0.03, err
    bf16 = teacher_forced(runner(tiny_loaded, torch.bfloat16), p, [60], tokens)
    assert rel(bf16, ref) < err  # (a finer storage errs less: the comparison measures the cache)
    k = next(iter(fp8_runner.k_cache.values()))
    assert k.dtype == FP8 and set(fp8_runner.k_scale) == set(fp8_runner.k_cache)
    full = next(iter(ref_runner.k_cache.values()))
    scale = next(iter(fp8_runner.k_scale.values()))
    assert k.nbytes + scale.nbytes <= full.nbytes // 2


def test_chunked_prefill_and_a_kept_prefix_attend_as_one_chunk_does(tiny_loaded):
    """With an FP8 cache a prompt prefilled in chunks of 16, 16 and 28 gives the logits of one 60-token chunk
    (each chunk attends to itself as the cache holds it), and so do the decode steps after it."""
    p = prompt(seed=1)
    tokens = [11, 22, 33, 44, 55, 66]
    one = teacher_forced(runner(tiny_loaded, FP8), p, [60], tokens)
    three = teacher_forced(runner(tiny_loaded, FP8), p, [16, 16, 28], tokens)
    assert torch.allclose(one, three, rtol=1e-4, atol=1e-4), rel(three, one)


def test_the_memory_plan_prices_an_fp8_token_at_its_bytes(tiny_loaded):
    """The geometry's KV bytes per token: 2 x (nkv x hd + 4 nkv) per attention layer with FP8 against
    2 x nkv x hd x 4 in fp32 (and the scales sit beside the caches with the same blocks)."""
    fp8 = runner(tiny_loaded, FP8, num_blocks=8)
    full = runner(tiny_loaded, num_blocks=8)
    geo = [g for kind, g in zip(fp8._forward._kinds, fp8._forward._geo) if kind == "full"]
    from qwen_chat.engine.model.state import Geometry

    g8 = Geometry(tuple(fp8._forward._kinds), tuple(fp8._forward._geo), torch.float32, FP8)
    g32 = Geometry(tuple(full._forward._kinds), tuple(full._forward._geo), torch.float32)
    assert g8.kv_token_bytes() == sum(2 * (g["nkv"] * g["hd"] + 4 * g["nkv"]) for g in geo)
    assert g32.kv_token_bytes() == sum(2 * g["nkv"] * g["hd"] * 4 for g in geo)
    for i, cache in fp8.k_cache.items():
        assert fp8.k_scale[i].shape == cache.shape[:-1] == fp8.v_scale[i].shape


@pytest.mark.parametrize("budget_gib,at_least", [(2.0, 1.6), (10.0, 1.65)])
def test_the_memory_plan_gives_qwen3_5_9b_more_kv_tokens_with_fp8(budget_gib, at_least):
    """Qwen3.5-9B's geometry (docs/facts.md: 24 Gated DeltaNet layers, 8 attention layers of 4 KV heads x 256):
    16,640 bytes per token instead of 32,768; the plan, which also buys state slots (48 MiB each) and the
    attention's scores (one row group's, ``memory.attention_rows``) from the budget, holds 1.6-1.7x the KV tokens
    of bf16 for the same slots."""
    from qwen_chat.engine.model.memory import plan_memory
    from qwen_chat.engine.model.state import Geometry

    linear = dict(dk=128, dv=128, K=4, conv_dim=8192, key_dim=2048, value_dim=4096, nk=16, nv=32)
    full = dict(hd=256, nq=16, nkv=4, groups=4, scale=256 ** -0.5)
    kinds = ("linear", "linear", "linear", "full") * 8
    geo = tuple(dict(linear) if k == "linear" else dict(full) for k in kinds)
    plans = [plan_memory(Geometry(kinds, geo, torch.bfloat16, kv), budget_bytes=int(budget_gib * 2 ** 30),
                         model_context=262144) for kv in (None, FP8)]
    assert [Geometry(kinds, geo, torch.bfloat16, kv).kv_token_bytes() for kv in (None, FP8)] == [32768, 16640]
    assert plans[1].num_slots == plans[0].num_slots
    assert plans[1].kv_tokens >= at_least * plans[0].kv_tokens


@pytest.fixture(scope="module")
def fp8_engine(tiny_loaded):
    r = runner(tiny_loaded, FP8)
    eng = ChatEngine(tiny_loaded, r, LocalExecutor(r, Sampler(3, r.vocab_size, "cpu")), image_token_budget=64,
                     max_context=256, max_queue=4, num_slots=3)
    yield eng
    eng.close()


def test_the_engine_serves_with_fp8_kv_and_a_conversation_cache_hit_equals_a_fresh_prefill(tiny_loaded,
                                                                                           fp8_engine):
    """Two turns on the engine with an FP8 cache: the second continues the first's kept state (a cache hit)
    and gives the reply a fresh engine gives for the whole conversation."""
    settings = GenerationSettings.preset(False, temperature=0.0, max_new_tokens=12)
    first = [ChatMessage(role="user", text="Tell me about the sea.")]
    reply = list(fp8_engine.stream_chat(first, settings, CancelToken()))[-1].answer
    second = first + [ChatMessage(role="assistant", text=reply), ChatMessage(role="user", text="And the sky?")]
    hits = fp8_engine.stats().get("prefix_cache_hits_total", 0)
    cached = list(fp8_engine.stream_chat(second, settings, CancelToken()))[-1].answer
    assert fp8_engine.stats().get("prefix_cache_hits_total", 0) > hits
    r = runner(tiny_loaded, FP8)
    fresh_engine = ChatEngine(tiny_loaded, r, LocalExecutor(r, Sampler(3, r.vocab_size, "cpu")),
                              image_token_budget=64, max_context=256, max_queue=4, num_slots=3)
    try:
        fresh = list(fresh_engine.stream_chat(second, settings, CancelToken()))[-1].answer
    finally:
        fresh_engine.close()
    assert cached == fresh and cached


@pytest.mark.slow  # two processes import deepspeed and build the model (~30 s on 2 CPU cores)
def test_tensor_parallel_with_an_fp8_cache_gives_the_tokens_of_one_rank(tmp_path):
    """Each rank quantises its own KV heads as one rank would (a scale per position and head): sharded over 2
    ranks the tokens are those of one rank and the logits agree to float rounding."""
    from qwen_chat.engine.checkpoints.tiny import tiny_config
    from tests.support.quantized_tp import fp8_kv_tp_body
    from tests.support.small_model import TOL
    from tests.support.two_ranks import run_two_ranks

    config = tiny_config()
    config.text_config.vocab_size = 1024
    for rep in run_two_ranks(functools.partial(fp8_kv_tp_body, config=config), tmp_path, "gloo"):
        assert rep["errors"] == [], rep
        assert rep["tp2"] == rep["tp1"], rep
        assert rep["rel_err"] <= TOL, rep


def test_speculative_steps_on_an_fp8_cache_give_the_plain_tokens(tiny_loaded):
    """The verify step writes its k + 1 positions through the FP8 cache as plain steps do: three sequences,
    k = 2, oracle drafts right 70 % of the time, give the greedy tokens of plain decoding on the same cache."""
    from qwen_chat.engine.core.scheduler import Scheduler
    from qwen_chat.engine.core.spec_policy import OracleDrafter
    from qwen_chat.engine.model import spec_step
    from qwen_chat.engine.types import SamplingParams

    ps = [prompt(20 + 7 * s, seed=s) for s in range(3)]
    sampling = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0,
                              max_new_tokens=40, stop_token_ids=())

    def greedy(k, drafter=None):
        r = runner(tiny_loaded, FP8)
        if k:
            spec_step.attach(r, None, k=k, max_batch=3)
        sched = Scheduler(LocalExecutor(r, Sampler(3, r.vocab_size, "cpu")), num_slots=3, max_queue=8, eos_ids=(),
                          max_context=256, num_blocks=r.num_blocks, block_tokens=16, prefill_token_budget=16,
                          speculative_tokens=k, drafter=drafter)
        try:
            handles = [sched.submit(p, sampling, CancelToken()) for p in ps]
            return [list(h) for h in handles], sched.stats()["totals"]
        finally:
            sched.shutdown()

    want, _ = greedy(0)
    cont = {tuple(p.input_ids.tolist()): w for p, w in zip(ps, want)}
    got, totals = greedy(2, OracleDrafter(cont, 0.7, seed=1))
    assert got == want
    assert totals["spec_steps"] > 0 and 0 < totals["spec_accepted"] < totals["spec_drafted"]


def test_the_models_endpoint_report_names_the_kv_storage(tiny_loaded):
    """``/v1/models``' engine report (``ChatEngine.memory_report``) says which element type the KV cache holds."""
    from qwen_chat.engine.model.memory import MemoryPlan

    plan = MemoryPlan(budget_bytes=2 ** 24, num_slots=3, num_blocks=8, block_tokens=16, max_context=128,
                      slot_bytes=0, kv_token_bytes=0, scores_bytes=0)
    reports = []
    for kv in (FP8, None):
        r = runner(tiny_loaded, kv, num_blocks=8)
        eng = ChatEngine(tiny_loaded, r, LocalExecutor(r, Sampler(3, r.vocab_size, "cpu")), image_token_budget=64,
                         max_context=128, max_queue=4, num_slots=3, memory=plan)
        try:
            reports.append(eng.memory_report()["kv_cache_dtype"])
        finally:
            eng.close()
    assert reports == ["float8_e4m3fn", "float32"]
