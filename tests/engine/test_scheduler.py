"""Scheduler and LocalExecutor against a small deterministic fake model (no transformers, fast).

The fake runner's next-token distribution depends only on the sequence's own tokens, so any cross-talk between
slots (a token routed to the wrong stream, a slot's state reused without ``free``) changes the output and is
caught by comparing each concurrent stream with its solo run.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from qwen_chat.chat_types import Busy, CancelToken, ContextTooLong, InvalidInput, NotReady
from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.core.handles import group_chunks
from qwen_chat.engine.types import PrefillItem, PreparedPrompt, SamplingParams, StepPlan
from qwen_chat.engine.core.scheduler import Scheduler
from tests.support.spy_executor import SpyExecutor

VOCAB = 64
EOS = 63


class FakeRunner:
    """Per-slot token history; logits peak at a hash of the history (EOS only when ``eos_after`` is reached)."""

    def __init__(self, num_slots: int, eos_after: int | None = None):
        self.num_slots = num_slots
        self.vocab_size = VOCAB
        self.max_context = 4096
        self.eos_after = eos_after
        self.seqs: dict[int, list[int]] = {}
        self.freed: list[int] = []
        self.prompt_lens: dict[int, int] = {}

    def _logits(self, seq: list[int], generated: int) -> torch.Tensor:
        logits = torch.zeros(VOCAB)
        h = 7
        for t in seq:
            h = (h * 31 + t) % 1009
        logits[h % (VOCAB - 1)] = 5.0
        logits[(h // 7) % (VOCAB - 1)] += 4.0  # a runner-up, so seeded sampling varies
        if self.eos_after is not None and generated >= self.eos_after:
            logits[EOS] = 50.0
        return logits

    def follow_blocks(self, changes, copies) -> None:
        """The scheduler's KV block tables for the step (this fake holds no KV cache: nothing to apply)."""

    def own_blocks(self) -> None:
        """After the scheduler (nothing to give back)."""

    def check(self, prompt: PreparedPrompt) -> None:
        """Where the real runner refuses a prompt (before any state changes); tests replace it."""

    def prefill_batch(self, chunks) -> torch.Tensor | None:
        for c in chunks:
            if c.start == 0:
                self.check(c.prompt)
        rows = []
        for c in chunks:
            ids = [int(t) for t in c.prompt.input_ids[:c.stop()]]
            if c.start == 0:
                assert c.slot not in self.seqs, f"slot {c.slot} prefilled without free"
                if c.logits:  # not a preempted sequence recomputing its cache: its prompt starts here
                    self.prompt_lens[c.slot] = c.prompt.num_tokens
            else:
                assert self.seqs[c.slot] == ids[:c.start], "a chunk that does not continue its slot"
            self.seqs[c.slot] = ids
            if c.stop() == c.prompt.num_tokens and c.logits:
                rows.append(self._logits(ids, len(ids) - self.prompt_lens[c.slot]))
        return torch.stack(rows) if rows else None

    def decode(self, slots: list[int], tokens, token_table=None) -> torch.Tensor:
        if tokens is None:  # overlap mode: the last sampled token of each slot, as the real runner reads it
            tokens = token_table[torch.tensor(slots)]
        assert tokens.dtype == torch.int64 and tokens.shape == (len(slots),)
        rows = []
        for slot, tok in zip(slots, tokens.tolist()):
            self.seqs[slot].append(tok)
            rows.append(self._logits(self.seqs[slot], len(self.seqs[slot]) - self.prompt_lens[slot]))
        return torch.stack(rows)

    def free(self, slot: int) -> None:
        self.freed.append(slot)
        self.seqs.pop(slot, None)

    def copy_slot(self, src: int, dst: int) -> None:
        assert dst not in self.seqs, f"slot {dst} copied into without free"
        self.seqs[dst] = list(self.seqs[src])
        self.prompt_lens[dst] = self.prompt_lens[src]


class FakeSampler:
    """Greedy at temperature 0, else seeded softmax sampling with one generator per slot."""

    def __init__(self, num_slots: int, vocab_size: int, device="cpu"):
        self.gens: dict[int, torch.Generator] = {}
        self.temps: dict[int, float] = {}
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64)

    def sample_async(self, slots, logits):
        out = torch.tensor(self.sample(slots, logits), dtype=torch.int64)
        self.last_tokens[torch.tensor(list(slots), dtype=torch.int64)] = out
        return out

    def start(self, slot: int, params: SamplingParams) -> None:
        self.gens[slot] = torch.Generator().manual_seed(params.seed)
        self.temps[slot] = params.temperature

    def sample(self, slots, logits):
        out = []
        for slot, row in zip(slots, logits):
            if self.temps[slot] == 0:
                out.append(int(row.argmax()))
            else:
                probs = torch.softmax(row / self.temps[slot], -1)
                out.append(int(torch.multinomial(probs, 1, generator=self.gens[slot])))
        return out


def prompt(*ids: int) -> PreparedPrompt:
    return PreparedPrompt(input_ids=torch.tensor(ids, dtype=torch.int64))


def params(max_new: int = 20, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=1.0, top_k=VOCAB, presence_penalty=0.0, seed=seed,
                          max_new_tokens=max_new, stop_token_ids=())


OVERLAP = False  # set per test by the ``mode`` fixture


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def mode(request):
    """Every test runs with the scheduler waiting for each step and with steps launched ahead (overlap)."""
    global OVERLAP
    OVERLAP = request.param
    yield request.param
    OVERLAP = False


def make(num_slots=2, max_queue=4, eos_after=None, gate=None, fail_on_step=None, max_context=None, on_fatal=None,
         error=None):
    runner = FakeRunner(num_slots, eos_after)
    ex = SpyExecutor(runner, FakeSampler(num_slots, VOCAB), gate=gate, fail_on_step=fail_on_step, error=error)
    sched = Scheduler(ex, num_slots=num_slots, max_queue=max_queue, eos_ids=(EOS,), max_context=max_context,
                      on_fatal=on_fatal, overlap=OVERLAP)
    return sched, ex, runner


@pytest.fixture
def cleanup():
    scheds = []
    yield scheds.append
    for s in scheds:
        s.shutdown()


def solo(p, sp, **kw):
    sched, _, _ = make(**kw)
    try:
        h = sched.submit(p, sp, CancelToken())
        return list(h), h.finish_reason
    finally:
        sched.shutdown()


def test_executor_runs_free_prefill_decode_in_order():
    runner = FakeRunner(2)
    ex = LocalExecutor(runner, FakeSampler(2, VOCAB))
    first = ex.execute(StepPlan(prefills=[PrefillItem(1, prompt(1, 2, 3), params())]))
    assert list(first) == [1]
    nxt = ex.execute(StepPlan(decode_slots=[1], decode_tokens=[first[1]]))
    assert runner.seqs[1] == [1, 2, 3, first[1]]
    assert int(runner._logits([1, 2, 3, first[1]], 4).argmax()) == nxt[1]
    ex.execute(StepPlan(free_slots=[1]))
    assert runner.freed == [1] and 1 not in runner.seqs


def test_executor_rejects_inconsistent_plans():
    ex = LocalExecutor(FakeRunner(2), FakeSampler(2, VOCAB))
    with pytest.raises(ValueError, match="differ in length"):
        ex.execute(StepPlan(decode_slots=[0, 1], decode_tokens=[3]))
    with pytest.raises(ValueError, match="unknown step op"):
        ex.execute(StepPlan(op="bogus"))
    assert ex.execute(StepPlan(op="exit")) == {}


def test_choices_share_the_prefill_that_free_slots_allow(cleanup):
    """n = 3 choices on 2 slots: the first two share one prefill (the second starts from a copy of the slot), the
    third gets its own once a slot frees; each choice streams what a request with its seed alone would."""
    p = prompt(3, 1, 4)
    samplings = [params(max_new=6, temperature=1.0, seed=40 + i) for i in range(3)]
    refs = [solo(p, sp)[0] for sp in samplings]
    sched, ex, _ = make(num_slots=2)
    cleanup(sched)
    handles = sched.submit_choices(p, samplings, CancelToken())
    got = {i: [] for i in range(3)}
    for chunk in group_chunks(handles):
        got[chunk.index] += chunk.ids
    assert [got[i] for i in range(3)] == refs
    assert [h.finish_reason for h in handles] == ["length"] * 3
    prefills = [item for plan in ex.plans for item in plan.prefills]
    assert len(prefills) == 2 and len(prefills[0].copies) == 1 and not prefills[1].copies
    assert sched.stats()["totals"]["requests"] == 1


def test_length_and_stop_reasons(cleanup):
    tokens, reason = solo(prompt(5, 6), params(max_new=12))
    assert reason == "length" and len(tokens) == 12
    tokens, reason = solo(prompt(5, 6), params(max_new=50), eos_after=5)
    # the decode that feeds the 5th sampled token yields EOS; EOS ends the stream without being streamed
    assert reason == "stop" and len(tokens) == 5 and EOS not in tokens


def test_greedy_stream_matches_reference_model():
    tokens, _ = solo(prompt(9, 8, 7), params(max_new=8))
    seq = [9, 8, 7]
    runner = FakeRunner(1)
    for tok in tokens:
        assert tok == int(runner._logits(seq, 0).argmax())
        seq.append(tok)


def test_concurrent_requests_batch_together_without_cross_talk(cleanup):
    p1, s1 = prompt(1, 2, 3), params(max_new=15, temperature=1.0, seed=11)
    p2, s2 = prompt(4, 5), params(max_new=25, temperature=1.0, seed=22)
    ref1, ref2 = solo(p1, s1)[0], solo(p2, s2)[0]
    gate = threading.Event()
    sched, ex, runner = make(num_slots=2, gate=gate)
    cleanup(sched)
    h1 = sched.submit(p1, s1, CancelToken())
    assert ex.step_started.wait(10)  # the scheduler is now inside its first step (h1's prefill)
    h2 = sched.submit(p2, s2, CancelToken())
    gate.set()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(1, list(h1)))
    t.start()
    out[2] = list(h2)
    t.join(10)
    assert out[1] == ref1 and out[2] == ref2
    assert h1.finish_reason == h2.finish_reason == "length"
    # h2 joined the running batch: some decode step contained both slots
    assert any(sorted(p.decode_slots) == [0, 1] for p in ex.plans)
    assert any(p.prefills and p.decode_slots for p in ex.plans), "h2 was prefilled between h1's decode steps"
    assert sched.stats()["totals"]["max_decode_batch"] == 2


def test_cancel_frees_slot_within_one_step_and_next_request_runs(cleanup):
    sched, ex, runner = make(num_slots=1, max_queue=1)
    cleanup(sched)
    cancel = CancelToken()
    h = sched.submit(prompt(3, 3), params(max_new=100000), cancel)
    got = []
    for tok in h:
        got.append(tok)
        if len(got) == 3:
            steps_at_cancel = len(ex.plans)
            cancel.cancel()
    assert h.finish_reason == "cancelled"
    # the step already running (and, in overlap mode, the one launched ahead), then the one that frees it
    assert len(ex.plans) <= steps_at_cancel + (3 if OVERLAP else 2)
    h2 = sched.submit(prompt(3, 3), params(max_new=4), CancelToken())
    assert len(list(h2)) == 4 and h2.finish_reason == "length"
    assert 0 in runner.freed
    assert sched.stats()["active"] == 0 and sched.stats()["totals"]["finished"]["cancelled"] == 1


def test_consumer_close_and_queued_cancel(cleanup):
    gate = threading.Event()
    sched, ex, runner = make(num_slots=1, max_queue=2, gate=gate)
    cleanup(sched)
    h1 = sched.submit(prompt(1), params(max_new=100000), CancelToken())
    assert ex.step_started.wait(10)
    c2 = CancelToken()
    h2 = sched.submit(prompt(2), params(max_new=5), c2)
    c2.cancel()  # cancelled while still waiting for a slot: never prefilled
    gate.set()
    next(iter(h1))
    h1.close()
    list(h1)  # drains what was sampled before the close reached the scheduler
    assert h1.finish_reason == "cancelled"
    assert list(h2) == [] and h2.finish_reason == "cancelled"
    assert all(item.prompt.input_ids.tolist() != [2] for p in ex.plans for item in p.prefills)


def test_queue_full_raises_busy(cleanup):
    gate = threading.Event()
    sched, ex, _ = make(num_slots=1, max_queue=1, gate=gate)
    cleanup(sched)
    sched.submit(prompt(1), params(max_new=10), CancelToken())
    sched.submit(prompt(2), params(max_new=10), CancelToken())
    with pytest.raises(Busy, match="busy, 1 requests queued, try again"):
        sched.submit(prompt(3), params(), CancelToken())
    assert sched.stats()["totals"]["rejected_busy"] == 1
    gate.set()


def test_executor_error_fails_requests_and_marks_unhealthy(cleanup):
    fatal = []
    sched, ex, _ = make(num_slots=2, fail_on_step=3, on_fatal=fatal.append)
    cleanup(sched)
    h = sched.submit(prompt(1, 2), params(max_new=50), CancelToken())
    toks = list(h)
    assert h.finish_reason == "error" and "engine failed while generating (RuntimeError)" in h.error
    assert len(toks) == 2  # prefill token and one decode token came before the failing step
    assert not sched.healthy and "simulated device error" in sched.stats()["reason"]
    assert fatal == ["engine step failed: RuntimeError: simulated device error"]  # the service exits on this
    # the slot was released; the scheduler keeps serving (the service/supervisor decide about restarts)
    h2 = sched.submit(prompt(1, 2), params(max_new=3), CancelToken())
    assert len(list(h2)) == 3 and h2.finish_reason == "length"


def test_executor_closed_under_a_stream_ends_it_as_a_shutdown_not_a_failure(cleanup):
    """Rank 0's SIGTERM closes the DistributedExecutor (the workers get their exit) while a step may still be
    queued: its launch raises NotReady.  That is a shutdown: the open streams end "cancelled" (the API then sends
    its final chunk and [DONE]), nothing is reported as an engine failure and the service exits 0."""
    fatal = []
    sched, ex, _ = make(num_slots=2, fail_on_step=3, on_fatal=fatal.append,
                        error=NotReady("the engine is shutting down"))
    cleanup(sched)
    h = sched.submit(prompt(1, 2), params(max_new=50), CancelToken())
    toks = list(h)
    assert h.finish_reason == "cancelled" and h.error == ""
    assert len(toks) == 2
    assert fatal == [] and "failed" not in sched.stats()["reason"]  # stopped, not broken
    with pytest.raises(NotReady):                                    # and it takes no new work
        sched.submit(prompt(3), params(), CancelToken())


def test_context_limit(cleanup):
    sched, _, _ = make(max_context=8)
    cleanup(sched)
    with pytest.raises(ContextTooLong):
        sched.submit(prompt(*range(8)), params(), CancelToken())
    h = sched.submit(prompt(*range(5)), params(max_new=100), CancelToken())
    assert len(list(h)) == 3 and h.finish_reason == "length"


def test_shutdown_ends_open_streams():
    sched, _, _ = make(num_slots=1, max_queue=3)
    h1 = sched.submit(prompt(1), params(max_new=10**9), CancelToken())
    h2 = sched.submit(prompt(2), params(max_new=10), CancelToken())
    next(iter(h1))
    sched.shutdown()
    list(h1), list(h2)
    assert h1.finish_reason == "cancelled" and h2.finish_reason == "cancelled"


def test_refused_prompt_fails_only_that_request(cleanup):
    """A ChatError from prefill (the runner refuses a prompt) fails only the new request; the running one
    continues with exactly the tokens of its solo run and the scheduler stays healthy."""
    ref, _ = solo(prompt(1, 2), params(max_new=12))
    gate = threading.Event()
    sched, ex, runner = make(num_slots=2, gate=gate)
    cleanup(sched)

    def refusing_check(p):
        if p.input_ids.tolist() == [66]:
            raise InvalidInput("prompt refused by the runner")

    runner.check = refusing_check
    fatal = []
    sched.on_fatal = fatal.append
    h1 = sched.submit(prompt(1, 2), params(max_new=12), CancelToken())
    assert ex.step_started.wait(10)
    h2 = sched.submit(prompt(66), params(max_new=5), CancelToken())
    gate.set()
    assert list(h2) == [] and h2.finish_reason == "error" and h2.error == "prompt refused by the runner"
    assert list(h1) == ref and h1.finish_reason == "length"
    assert sched.healthy and fatal == []  # a refused prompt is not an engine failure


def test_real_runner_batched_streams_equal_solo_streams():
    """With the real ModelRunner and Sampler (the small random Qwen3.5 config of tests/support/small_model.py),
    three requests of different prompt lengths, seeds and limits, decoded together, give exactly their solo token
    streams."""
    from transformers import Qwen3_5ForConditionalGeneration

    from qwen_chat.engine.model.runner import ModelRunner
    from qwen_chat.engine.model.sampling import Sampler
    from tests.support.small_model import small_config

    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(small_config()).eval()
    runner = ModelRunner(model, num_slots=3, max_context=256, device="cpu")
    ex = SpyExecutor(runner, Sampler(3, runner.vocab_size, "cpu"))
    sched = Scheduler(ex, num_slots=3, max_queue=4, eos_ids=(runner.vocab_size - 1,), max_context=256,
                      overlap=OVERLAP)
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [PreparedPrompt(input_ids=torch.randint(0, 300, (n,), generator=g)) for n in (5, 17, 9)]
        sps = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, presence_penalty=0.5, seed=i,
                              max_new_tokens=12 + 6 * i, stop_token_ids=()) for i in range(3)]
        solo_runs = [list(sched.submit(p, s, CancelToken())) for p, s in zip(prompts, sps)]
        assert [len(t) for t in solo_runs] == [12, 18, 24]
        first = len(ex.plans)
        handles = [sched.submit(p, s, CancelToken()) for p, s in zip(prompts, sps)]
        assert [list(h) for h in handles] == solo_runs
        assert max(len(p.decode_slots) for p in ex.plans[first:]) >= 2
    finally:
        sched.shutdown()


def test_prefill_budget_splits_long_prompts_into_chunks(cleanup):
    """With a budget of 10 prompt tokens per step, prompts of 8 and 25 tokens go in chunks (the long one over
    several steps, next to the running decode), no step prefills more than 10 tokens, and every stream equals
    its solo run."""
    refs = [solo(prompt(*range(n)), params(max_new=4))[0] for n in (8, 25)]
    gate = threading.Event()
    runner = FakeRunner(3)
    ex = SpyExecutor(runner, FakeSampler(3, VOCAB), gate=gate)
    sched = Scheduler(ex, num_slots=3, max_queue=4, eos_ids=(EOS,), prefill_token_budget=10, overlap=OVERLAP)
    cleanup(sched)
    h0 = sched.submit(prompt(1), params(max_new=30), CancelToken())
    assert ex.step_started.wait(10)
    handles = [sched.submit(prompt(*range(n)), params(max_new=4), CancelToken()) for n in (8, 25)]
    gate.set()
    list(h0)
    assert [list(h) for h in handles] == refs
    sizes = [sum(i.stop() - i.start for i in p.prefills) for p in ex.plans if p.prefills]
    assert max(sizes) <= 10 and sum(sizes) == 1 + 8 + 25
    chunks = [(i.start, i.stop()) for p in ex.plans for i in p.prefills if i.prompt.num_tokens == 25]
    assert chunks == [(0, 2), (2, 12), (12, 22), (22, 25)]
    assert any(p.prefills and p.decode_slots for p in ex.plans)


def test_twenty_stop_cycles_leave_no_slot_or_state_behind(cleanup):
    """Stop (cancel) or a closed consumer (the user pressed Stop or closed the tab), 20 times in a row; every
    slot and every runner state is released afterwards and a normal request still gets its full reply."""
    sched, ex, runner = make(num_slots=2, max_queue=2)
    cleanup(sched)
    for i in range(20):
        cancel = CancelToken()
        h = sched.submit(prompt(i, 1), params(max_new=10**6), cancel)
        stream = iter(h)
        next(stream), next(stream)
        cancel.cancel() if i % 2 else h.close()
        list(stream)
        assert h.finish_reason == "cancelled"
    h = sched.submit(prompt(7), params(max_new=6), CancelToken())
    assert len(list(h)) == 6
    deadline = time.monotonic() + 10
    while runner.seqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.seqs == {}  # every slot freed in the runner, not just in the scheduler
    stats = sched.stats()
    assert stats["active"] == 0 and stats["queued"] == 0
    assert stats["totals"]["finished"] == {"stop": 0, "length": 1, "cancelled": 20, "error": 0}


class OrderExecutor(SpyExecutor):
    """Records the order of launches (with the step's prompt tokens) and collects."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.events: list[tuple[str, int]] = []

    def launch(self, plan: StepPlan):
        self.events.append(("launch", sum(i.stop() - i.start for i in plan.prefills)))
        return super().launch(plan)

    def collect(self, launched):
        self.events.append(("collect", 0))
        return super().collect(launched)


def test_a_long_prefill_is_launched_after_the_step_in_flight_delivered_its_tokens(cleanup):
    """A step whose launch takes long (a prefill of more than ``COLLECT_FIRST_TOKENS`` prompt tokens: eager
    kernels, as long to launch as to run) starts only after the step in flight was collected, so that step's
    tokens reach their streams first; a short prefill (a CUDA-graph replay) is launched ahead as before; the
    streams equal their solo runs either way."""
    from qwen_chat.engine.core.scheduler import COLLECT_FIRST_TOKENS

    long_p = prompt(*[t % 60 for t in range(COLLECT_FIRST_TOKENS + 76)])
    refs = [solo(p, params(max_new=4))[0] for p in (prompt(5, 6, 7), long_p)]
    runner = FakeRunner(3)
    ex = OrderExecutor(runner, FakeSampler(3, VOCAB))
    sched = Scheduler(ex, num_slots=3, max_queue=4, eos_ids=(EOS,), prefill_token_budget=4096, overlap=OVERLAP)
    cleanup(sched)
    running = sched.submit(prompt(1), params(max_new=400), CancelToken())
    it = iter(running)
    for _ in range(3):
        next(it)  # decoding
    short = sched.submit(prompt(5, 6, 7), params(max_new=4), CancelToken())
    assert list(short) == refs[0]
    long_h = sched.submit(long_p, params(max_new=4), CancelToken())
    assert list(long_h) == refs[1]
    events = list(ex.events)

    def in_flight_at(size: int) -> int:
        """Launched but not collected steps when the step prefilling ``size`` tokens is launched."""
        at = events.index(("launch", size))
        return sum(e == "launch" for e, _ in events[:at]) - sum(e == "collect" for e, _ in events[:at])

    assert in_flight_at(long_p.num_tokens) == 0
    assert in_flight_at(3) == (1 if OVERLAP else 0)
