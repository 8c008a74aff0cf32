"""Paged KV bookkeeping and the scheduler under a small memory budget: blocks follow the sequences' lengths,
preempted sequences come back with the same tokens, and nothing leaks.

``BlockTables`` (the runner's allocator) and ``BlockBudget`` (the scheduler's count) are exercised directly with
random operations; then the scheduler drives a fake runner that allocates through a real ``BlockTables`` (so a
count that disagrees with the runner fails with ``OutOfBlocks``), and the real runner on the small random model.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from qwen_chat.chat_types import CancelToken
from qwen_chat.engine.model.memory import MemoryBudgetError, plan_memory
from qwen_chat.engine.model.paged import BlockTables, OutOfBlocks, blocks_for
from qwen_chat.engine.model.state import Geometry
from qwen_chat.engine.types import PreparedPrompt, SamplingParams
from qwen_chat.engine.core.scheduler import Scheduler
from tests.engine.test_scheduler import VOCAB, FakeRunner, FakeSampler
from tests.support.spy_executor import SpyExecutor


def test_block_tables_allocate_grow_free_and_never_leak():
    """1,000 random grows and releases over 6 slots: every block is owned by at most one slot, the device table
    mirrors the host lists after each flush, an allocation beyond the free blocks raises and changes nothing,
    and at the end every block is free again."""
    rng = random.Random(0)
    t = BlockTables(num_slots=6, num_blocks=20, max_blocks=8, device=torch.device("cpu"), block_tokens=4)
    lengths = [0] * 6
    for _ in range(1000):
        s = rng.randrange(6)
        if rng.random() < 0.3:
            t.release(s)
            lengths[s] = 0
        else:
            n = min(32, lengths[s] + rng.randint(1, 9))
            try:
                t.ensure(s, n)
                lengths[s] = n
            except OutOfBlocks:
                assert len(t.blocks(s)) == blocks_for(lengths[s], 4)  # unchanged
        owned = [b for slot in range(6) for b in t.blocks(slot)]
        assert len(owned) == len(set(owned)) and len(owned) + t.free_blocks == 20
        assert all(len(t.blocks(slot)) == blocks_for(lengths[slot], 4) for slot in range(6))
        t.flush()
        for slot in range(6):
            row = t.device_table[slot].tolist()
            k = len(t.blocks(slot))
            assert row[:k] == list(t.blocks(slot)) and set(row[k:]) <= {t.null_block}
    for s in range(6):
        t.release(s)
    assert t.free_blocks == 20
    assert t.positions(0, 0, 0).numel() == 0


def test_a_runner_follows_the_schedulers_tables_and_owns_them_again_after():
    """The scheduler's allocator (no device) ships its changes; the runner's tables applied to them hold the same
    ids, on the device too; following, the runner allocates nothing and checks (too few blocks: OutOfBlocks;
    another prefix shared: ValueError); ``own`` rebuilds its free list from the tables it holds."""
    sched = BlockTables(num_slots=4, num_blocks=12, max_blocks=6, device=None, block_tokens=4)
    run = BlockTables(num_slots=4, num_blocks=12, max_blocks=6, device=torch.device("cpu"), block_tokens=4)
    run.ensure(3, 8)  # a block the runner held on its own before: following starts from empty tables
    sched.ensure(0, 9)
    sched.ensure(1, 4)
    sched.share(2, sched.blocks(0)[:2])
    run.follow(sched.take_changes())
    assert run.following and [run.blocks(s) for s in range(4)] == [sched.blocks(s) for s in range(4)]
    run.flush()
    assert run.device_table[0, :3].tolist() == list(sched.blocks(0)) and run.device_table[3, 0] == run.null_block
    assert run.free_blocks == 12 - 4
    run.ensure(0, 12)  # the plan gave slot 0 three blocks: a check, nothing allocated
    with pytest.raises(OutOfBlocks, match="slot 1 holds 1 KV block"):
        run.ensure(1, 5)
    run.share(2, sched.blocks(0)[:2])
    with pytest.raises(ValueError, match="the plan's tables differ"):
        run.share(2, sched.blocks(1))
    run.release(0)  # the plan releases; the runner's own call changes nothing
    assert run.blocks(0) == sched.blocks(0)
    sched.release(0)
    sched.ensure(0, 2)
    run.follow(sched.take_changes())
    assert [run.blocks(s) for s in range(4)] == [sched.blocks(s) for s in range(4)]
    run.own()
    assert not run.following and run.free_blocks == sched.free_blocks
    run.ensure(3, 4)
    assert run.blocks(3)[0] not in {b for s in range(3) for b in run.blocks(s)}


def test_memory_plan_splits_the_budget_and_refuses_one_that_holds_no_sequence():
    """The 9B's geometry (24 Gated DeltaNet layers of 32 x 128 x 128 fp32 state, 8 attention layers of 4 KV
    heads x 256): slots take at most half the budget, the rest is KV blocks, the context is capped by the model
    and by what the blocks hold; a budget too small for one sequence fails with the numbers and the flags."""
    lin = dict(dk=128, dv=128, K=4, conv_dim=8192, key_dim=2048, value_dim=4096, nk=16, nv=32)
    full = dict(hd=256, nq=16, nkv=4, groups=4, scale=0.0625)
    geo = Geometry(tuple(["linear"] * 3 + ["full"]) * 8, tuple([lin] * 3 + [full]) * 8, torch.bfloat16)
    assert geo.slot_bytes() == 24 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)   # ~48.8 MiB
    assert geo.kv_token_bytes() == 32 * 1024                                # docs/facts.md: 32 KiB per token
    big = plan_memory(geo, budget_bytes=100 * 2**30, model_context=262144)
    assert big.num_slots == 128 and big.max_context == 262144
    assert big.num_blocks * 64 * geo.kv_token_bytes() + 128 * geo.slot_bytes() <= 100 * 2**30
    small = plan_memory(geo, budget_bytes=3 * 2**30, model_context=262144)
    assert small.num_slots == 31 and 2048 <= small.max_context == small.kv_tokens < 262144
    capped = plan_memory(geo, budget_bytes=3 * 2**30, model_context=262144, max_slots=4, max_context=8192)
    assert capped.num_slots == 4 and capped.max_context == 8192
    with pytest.raises(MemoryBudgetError, match=r"not one sequence of 32768 tokens: lower --max-context"):
        plan_memory(geo, budget_bytes=2 * 2**30, model_context=262144, max_context=32768)
    with pytest.raises(MemoryBudgetError, match="--gpu-memory-utilization"):
        plan_memory(geo, budget_bytes=30 * 2**20, model_context=262144)


class PagedFakeRunner(FakeRunner):
    """The scheduler tests' fake model, allocating KV blocks exactly as the real runner does."""

    def __init__(self, num_slots: int, num_blocks: int, block_tokens: int, **kw):
        super().__init__(num_slots, **kw)
        self.tables = BlockTables(num_slots=num_slots, num_blocks=num_blocks, max_blocks=64,
                                  device=torch.device("cpu"), block_tokens=block_tokens)

    budget = None  # the scheduler's ``BlockBudget``: when set, every plan must leave the runner's tables equal

    def follow_blocks(self, changes, copies):
        self.tables.follow(changes)  # the scheduler's tables: the calls below then check them
        assert not copies  # no conversation cache here: nothing is restored
        if self.budget is not None:
            for row in range(self.num_slots):
                assert tuple(self.tables.blocks(row)) == self.budget.table(row), f"row {row} differs"

    def own_blocks(self):
        self.tables.own()

    def prefill_batch(self, chunks):
        for c in chunks:
            if c.start == 0:
                self.tables.release(c.slot)
            self.tables.ensure(c.slot, c.stop())
        return super().prefill_batch(chunks)

    def decode(self, slots, tokens, token_table=None):
        for s in slots:
            self.tables.ensure(s, len(self.seqs[s]) + 1)
        return super().decode(slots, tokens, token_table)

    def free(self, slot):
        self.tables.release(slot)
        super().free(slot)


def wait_all_free(runner, n: int) -> None:
    """The runner frees a finished sequence's blocks in the step after it finished: wait for that step."""
    deadline = time.monotonic() + 10
    while runner.tables.free_blocks != n and time.monotonic() < deadline:
        time.sleep(0.01)


def sp(max_new: int, seed: int = 0, temperature: float = 0.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=1.0, top_k=VOCAB, presence_penalty=0.0, seed=seed,
                          max_new_tokens=max_new, stop_token_ids=())


def make_sched(num_slots, num_blocks, block_tokens, overlap, budget=8):
    runner = PagedFakeRunner(num_slots, num_blocks, block_tokens)
    ex = SpyExecutor(runner, FakeSampler(num_slots, VOCAB))
    sched = Scheduler(ex, num_slots=num_slots, max_queue=64, eos_ids=(VOCAB - 1,), max_context=200,
                      num_blocks=num_blocks, block_tokens=block_tokens, prefill_token_budget=budget, overlap=overlap)
    runner.budget = sched._batch.kv
    return sched, ex, runner


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_preempted_sequences_resume_with_the_tokens_of_their_solo_run(overlap):
    """Six sequences that together need more KV blocks than there are: the newest are preempted and recomputed
    (prompt + fed tokens), and every stream, seeded sampling included, equals its solo run."""
    def prompt(i):
        return PreparedPrompt(input_ids=torch.tensor([(7 * i + j) % 60 for j in range(5 + 3 * i)]))

    params = [sp(30, seed=i, temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    solo_sched, _, _ = make_sched(1, 30, 4, overlap)
    try:
        solo = [list(solo_sched.submit(prompt(i), params[i], CancelToken())) for i in range(6)]
    finally:
        solo_sched.shutdown()
    sched, ex, runner = make_sched(6, 30, 4, overlap)
    try:
        handles = [sched.submit(prompt(i), params[i], CancelToken()) for i in range(6)]
        assert [list(h) for h in handles] == solo
        stats = sched.stats()
        assert stats["totals"]["preemptions"] > 0
        assert stats["kv_blocks_used"] == 0
        assert any(item.resume for p in ex.plans for item in p.prefills)
        wait_all_free(runner, 30)
    finally:
        sched.shutdown()
    assert runner.tables.free_blocks == 30


def test_a_thousand_random_joins_stops_and_preemptions_leak_no_block():
    """Random prompts, lengths and Stops (cancel or a closed stream) under a budget that forces preemption: the
    runner never runs out of blocks (its allocator would raise), streams that were not stopped equal their
    solo runs, and afterwards the scheduler's count and the runner's free list hold every block."""
    rng = random.Random(1)
    sched, ex, runner = make_sched(4, 14, 4, overlap=True, budget=6)
    outs = []
    try:
        live = []
        for i in range(1000):
            ids = tuple(rng.randrange(60) for _ in range(rng.randint(1, 12)))
            n = rng.randint(1, 20)
            cancel = CancelToken()
            h = sched.submit(PreparedPrompt(input_ids=torch.tensor(ids)), sp(n), cancel)
            live.append((ids, n, h, cancel, rng.random()))
            if len(live) >= 8 or i == 999:
                for ids, n, h, cancel, r in live:
                    if r < 0.15:
                        cancel.cancel()
                    elif r < 0.25:
                        h.close()
                    else:
                        outs.append((ids, n, list(h), h.finish_reason))
                live = []
        assert sched.healthy
        assert sched.stats()["totals"]["preemptions"] > 0
        wait_all_free(runner, 14)
    finally:
        sched.shutdown()
    assert sched.stats()["kv_blocks_used"] == 0
    assert runner.tables.free_blocks == 14
    solo, _, _ = make_sched(1, 14, 4, overlap=False, budget=64)
    try:
        for ids, n, out, reason in outs:
            assert reason == "length"
            assert out == list(solo.submit(PreparedPrompt(input_ids=torch.tensor(ids)), sp(n), CancelToken()))
    finally:
        solo.shutdown()


def test_real_runner_preempted_sequences_give_the_greedy_tokens_of_uninterrupted_ones():
    """The small random Qwen3.5 (fp32, CPU) under 10 KV blocks of 16 tokens for four sequences of up to 70
    tokens, prompts prefilled in chunks of 24 tokens: the newest sequences are preempted and recomputed, and
    every greedy stream equals its run alone with blocks to spare."""
    from qwen_chat.engine.model.runner import ModelRunner
    from qwen_chat.engine.model.sampling import Sampler
    from tests.support.small_model import small_model

    model = small_model()
    gen = torch.Generator().manual_seed(5)
    prompts = [PreparedPrompt(input_ids=torch.randint(0, 290, (n,), generator=gen)) for n in (20, 33, 27, 40)]
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0,
                            max_new_tokens=30, stop_token_ids=())

    def run(num_slots, num_blocks):
        runner = ModelRunner(model, num_slots=num_slots, max_context=160, num_blocks=num_blocks, device="cpu",
                             block_tokens=16)
        sched = Scheduler(SpyExecutor(runner, Sampler(num_slots, runner.vocab_size, "cpu")), num_slots=num_slots,
                          max_queue=8, eos_ids=(), max_context=160, num_blocks=num_blocks, block_tokens=16,
                          prefill_token_budget=24, overlap=True)
        try:
            handles = [sched.submit(p, greedy, CancelToken()) for p in prompts]
            return [list(h) for h in handles], sched.stats()["totals"]["preemptions"]
        finally:
            sched.shutdown()

    spare, none = run(4, 40)
    tight, preemptions = run(4, 10)
    assert none == 0 and preemptions > 0
    assert tight == spare and all(len(t) == 30 for t in tight)
