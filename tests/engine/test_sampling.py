"""Sampler semantics: greedy, seeds, top-k, top-p, presence and frequency penalties, independence from batch
composition, the thinking budget, log-probabilities."""
from __future__ import annotations

import math

import pytest
import torch

from qwen_chat.engine.types import SamplingParams
from qwen_chat.engine.model.sampling import Sampler, nucleus_probs, scaled_logits

V = 50


def params(temperature=1.0, top_p=1.0, top_k=0, presence_penalty=0.0, seed=0, **extra) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, presence_penalty=presence_penalty,
                          seed=seed, max_new_tokens=100, stop_token_ids=(), **extra)


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def draw(sampler: Sampler, slot: int, logits: torch.Tensor, n: int) -> list[int]:
    return [sampler.sample([slot], logits[None])[0] for _ in range(n)]


def test_temperature_zero_is_argmax_and_ignores_penalty():
    s = Sampler(2, V, "cpu")
    s.start(0, params(temperature=0.0, presence_penalty=2.0, seed=3))
    lg = logits_batch(5)
    for row in lg:
        assert draw(s, 0, row, 3) == [int(row.argmax())] * 3


@pytest.mark.parametrize("fused_top_k", [64, 0], ids=["fused", "general"])
def test_tiny_temperatures_are_greedy(fused_top_k):
    """Temperatures down to float32's smallest subnormal are argmax, alone and next to a sampled row (in
    float32, x / 1e-40 overflows to inf and 1e-45 may be flushed to 0 on a GPU: either used to sample at
    temperature 1 or from NaN probabilities)."""
    lg = logits_batch(6, seed=4) * 0.2  # flat: sampling at temperature 1 would rarely hit the argmax
    temps = [1e-45, 1e-40, 1e-38, 0.0]
    s = Sampler(len(temps) + 1, V, "cpu", fused_top_k=fused_top_k)
    for slot, t in enumerate(temps):
        s.start(slot, params(temperature=t, top_k=20, presence_penalty=1.0, seed=slot))
    s.start(len(temps), params(temperature=1.0, top_k=20, seed=9))
    for row in lg:
        assert s.sample(list(range(len(temps))), row.expand(len(temps), V).clone()) == [int(row.argmax())] * 4
        mixed = s.sample(list(range(len(temps) + 1)), row.expand(len(temps) + 1, V).clone())
        assert mixed[:4] == [int(row.argmax())] * 4


def test_top_k_one_equals_greedy():
    s = Sampler(1, V, "cpu")
    s.start(0, params(temperature=1.3, top_k=1, seed=11))
    lg = logits_batch(20, seed=1)
    assert s.sample([0], lg[:1]) == [int(lg[0].argmax())]
    for row in lg[1:]:
        s.start(0, params(temperature=1.3, top_k=1, seed=11))
        assert s.sample([0], row[None]) == [int(row.argmax())]


def test_same_seed_same_tokens_other_seed_other_tokens():
    lg = logits_batch(1, seed=2)[0] * 0.2  # flat distribution: many tokens likely
    runs = []
    for seed in (7, 7, 8):
        s = Sampler(1, V, "cpu")
        s.start(0, params(seed=seed))
        runs.append(draw(s, 0, lg, 40))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len(set(runs[0])) > 5


def test_tokens_do_not_depend_on_batch_composition():
    """Slot 1's tokens are the same alone, in a batch with slot 0, and in a different row order."""
    lg = logits_batch(2, seed=3) * 0.3
    solo = Sampler(3, V, "cpu")
    solo.start(1, params(seed=5))
    alone = [solo.sample([1], lg[1:2])[0] for _ in range(30)]
    mixed = Sampler(3, V, "cpu")
    mixed.start(1, params(seed=5))
    mixed.start(0, params(seed=99, top_p=0.5))
    together = []
    for i in range(30):
        if i % 2:
            together.append(mixed.sample([0, 1], lg)[1])
        else:
            together.append(mixed.sample([1, 0], lg.flip(0))[0])
    assert together == alone


def filtered_distribution(lg: torch.Tensor, presence: torch.Tensor, penalty: float, temperature: float, top_k: int,
                          top_p: float) -> torch.Tensor:
    """The distribution both sampling paths draw one row from (``scaled_logits``, the top-k candidates,
    ``nucleus_probs``), scattered back to vocabulary order: float32 [V]."""
    x = scaled_logits(lg, presence, torch.tensor([penalty]), torch.tensor([temperature]), torch.tensor([0]))
    vals, ids = torch.topk(x, top_k, dim=-1) if top_k else torch.sort(x, dim=-1, descending=True)
    probs = nucleus_probs(vals, torch.tensor([top_k]), torch.tensor([top_p]))
    return torch.zeros(1, V).scatter_(1, ids, probs)[0]


def test_distribution_matches_definition():
    """Penalty on generated tokens, then temperature, top-k, top-p: checked against a direct computation, and
    the sampler draws only from its support."""
    s = Sampler(1, V, "cpu")
    p = params(temperature=0.7, top_k=10, top_p=0.6, presence_penalty=1.5, seed=1)
    s.start(0, p)
    lg = logits_batch(1, seed=4)
    s.presence[0, [int(lg[0].argmax()), 3]] = True  # as if generated earlier in this reply
    got = filtered_distribution(lg, s.presence, 1.5, 0.7, 10, 0.6)

    x = lg[0].clone()
    x[int(lg[0].argmax())] -= 1.5
    x[3] -= 1.5
    x = x / 0.7
    top = torch.topk(x, 10)
    probs = torch.softmax(top.values, -1)
    keep, mass = [], 0.0
    for pr, tok in zip(probs.tolist(), top.indices.tolist()):
        if mass >= 0.6:
            break
        keep.append((tok, pr))
        mass += pr
    expected = torch.zeros(V)
    for tok, pr in keep:
        expected[tok] = pr / mass
    assert torch.allclose(got, expected, atol=1e-6)
    assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-6)
    support, penalised = {tok for tok, _ in keep}, s.presence[0].clone()
    for _ in range(100):
        s.presence[0] = penalised  # each draw marks its token: keep the penalised set fixed
        assert s.sample([0], lg)[0] in support


def test_presence_penalty_lowers_repeated_tokens():
    lg = torch.zeros(1, V)
    lg[0, 4] = 3.0
    lg[0, 9] = 2.5
    presence = torch.zeros(1, V, dtype=torch.bool)
    before = filtered_distribution(lg, presence, 0.0, 1.0, 0, 1.0)
    presence[0, 4] = True
    after = filtered_distribution(lg, presence, 2.0, 1.0, 0, 1.0)
    # Token 4's logit drops by 2.0: its odds against token 9 shrink by exactly e^2.
    assert math.isclose(float(before[4] / before[9]), math.exp(0.5), rel_tol=1e-5)
    assert math.isclose(float(after[4] / after[9]), math.exp(-1.5), rel_tol=1e-5)
    # Sampling marks what it drew; start() clears the flags.
    s = Sampler(1, V, "cpu")
    s.start(0, params(presence_penalty=2.0, seed=2))
    tok = s.sample([0], lg)[0]
    assert bool(s.presence[0, tok])
    s.start(0, params(presence_penalty=2.0, seed=2))
    assert not bool(s.presence[0].any())


def test_top_p_small_keeps_only_the_nucleus():
    lg = torch.tensor([[4.0, 3.0, 2.0] + [-10.0] * (V - 3)])
    s = Sampler(1, V, "cpu")
    s.start(0, params(top_p=0.1, seed=4))
    assert set(draw(s, 0, lg[0], 50)) == {0}  # top token alone has mass >= 0.1
    s.start(0, params(top_p=0.8, seed=4))
    probs = torch.softmax(lg[0], -1)
    assert float(probs[0]) < 0.8 <= float(probs[0] + probs[1])
    assert set(draw(s, 0, lg[0], 200)) == {0, 1}


def test_sample_frequencies_follow_the_distribution():
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    s = Sampler(1, V, "cpu")
    s.start(0, params(seed=123))
    counts = torch.bincount(torch.tensor(draw(s, 0, lg[0], 3000)), minlength=V).float() / 3000
    assert torch.allclose(counts[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_bad_calls_raise():
    s = Sampler(2, V, "cpu")
    with pytest.raises(ValueError):
        s.sample([0], torch.zeros(1, V))  # not started
    with pytest.raises(ValueError):
        s.start(0, params(top_p=0.0))
    s.start(0, params())
    with pytest.raises(ValueError):
        s.sample([0], torch.zeros(1, V + 1))


def test_fused_top_k_path_draws_the_same_tokens_as_the_general_path():
    """Rows that all have 0 < top_k <= FUSED_TOPK go through ``draw_top_k`` (compiled on CUDA); it must draw
    exactly what the general sort/top-k path draws from the same seeds and logits, penalties and a greedy row
    included."""
    gen = torch.Generator().manual_seed(3)
    rows = [params(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=5),
            params(temperature=1.0, top_p=0.95, top_k=64, seed=6),
            params(temperature=0.0, top_k=20, seed=7),
            params(temperature=0.6, top_p=0.95, top_k=1, presence_penalty=0.5, seed=8)]
    fused, general = Sampler(4, 500, "cpu"), Sampler(4, 500, "cpu", fused_top_k=0)  # general: never fused
    for s in (fused, general):
        for slot, p in enumerate(rows):
            s.start(slot, p)
    drawn = []
    for _ in range(60):
        logits = torch.randn(4, 500, generator=gen) * 3
        a, b = fused.sample([0, 1, 2, 3], logits), general.sample([0, 1, 2, 3], logits)
        assert a == b
        assert a[2] == int(logits[2].argmax())
        drawn.append(a[0])
    assert len(set(drawn)) > 5  # really sampling, not collapsing to the argmax


def test_a_failing_compiled_sampler_falls_back_to_the_same_maths(caplog):
    """If compiling the fused path fails at start-up (a GPU or driver Inductor cannot handle), the sampler keeps
    serving with the uncompiled function instead of failing every request."""
    from qwen_chat.engine.model import sampling

    s = Sampler(2, V, "cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no kernel for this GPU")

    s._draw_top_k = broken
    with caplog.at_level("WARNING"):
        s.warm_up()
    assert s._draw_top_k is sampling.draw_top_k
    assert "runs uncompiled" in caplog.text
    s.start(0, params(temperature=0.7, top_k=20, seed=1))
    assert 0 <= s.sample([0], logits_batch(1))[0] < V


def greedy_with_counts(lg: torch.Tensor, steps: int, frequency: float, presence: float) -> list[int]:
    """Reference: argmax of ``logit - frequency * count - presence * (count > 0)`` step by step."""
    counts = torch.zeros(V)
    out = []
    for _ in range(steps):
        tok = int((lg - frequency * counts - presence * (counts > 0).float()).argmax())
        counts[tok] += 1
        out.append(tok)
    return out


@pytest.mark.parametrize("top_k", [0, 20])  # the general path and the fused top-k path
def test_frequency_penalty_subtracts_per_occurrence(top_k):
    """Token 4 leads token 9 by 0.5 and token 13 by 0.95: with frequency_penalty 0.3 it is drawn until two
    occurrences cost 0.6, then the others take turns as their counts grow (at a temperature so low that each
    draw is the argmax); a presence penalty of 0.3 costs token 4 only once, so it keeps winning."""
    lg = torch.full((V,), -20.0)
    lg[4], lg[9], lg[13] = 3.0, 2.5, 2.05
    s = Sampler(1, V, "cpu")
    s.start(0, params(temperature=0.001, top_k=top_k, frequency_penalty=0.3, seed=1))
    got = draw(s, 0, lg, 12)
    assert got == greedy_with_counts(lg, 12, frequency=0.3, presence=0.0)
    assert got[:3] == [4, 4, 9] and {4, 9, 13} <= set(got)
    s.start(0, params(temperature=0.001, top_k=top_k, presence_penalty=0.3, seed=1))
    assert set(draw(s, 0, lg, 12)) == {4}
    s.start(0, params(temperature=0.001, top_k=top_k, frequency_penalty=-0.5, seed=1))  # negative: repeat more
    assert set(draw(s, 0, lg, 12)) == {4}
    s.start(0, params(temperature=0.0, frequency_penalty=2.0, seed=1))  # greedy ignores penalties
    assert set(draw(s, 0, lg, 6)) == {4}


def test_frequency_counts_start_fresh_and_stay_in_their_slot():
    lg = torch.full((V,), -20.0)
    lg[4], lg[9] = 3.0, 2.5
    s = Sampler(2, V, "cpu")
    s.start(0, params(temperature=0.001, frequency_penalty=0.3, seed=1))
    s.start(1, params(temperature=0.001, seed=2))
    for _ in range(4):
        s.sample([0, 1], torch.stack([lg, lg]))
    assert float(s.frequency.counts[0].sum()) == 4
    s.start(0, params(temperature=0.001, frequency_penalty=0.3, seed=1))  # a new reply: counts cleared
    assert float(s.frequency.counts[0].sum()) == 0
    assert draw(s, 0, lg, 3) == [4, 4, 9]


def test_thinking_budget_forces_the_end_of_thinking():
    END = 7
    lg = torch.full((V,), -20.0)
    lg[4] = 3.0
    s = Sampler(2, V, "cpu")
    s.start(0, params(temperature=0.0, reasoning_budget=3, think_end_id=END))
    assert draw(s, 0, lg, 6) == [4, 4, 4, END, 4, 4]  # once closed, never forced again
    s.start(0, params(temperature=0.0, reasoning_budget=0, think_end_id=END))
    assert draw(s, 0, lg, 2) == [END, 4]
    own = lg.clone()
    own[END] = 5.0  # the model closes its thinking itself, within the budget
    s.start(0, params(temperature=0.0, reasoning_budget=3, think_end_id=END))
    s.start(1, params(temperature=0.7, seed=3))  # no budget: never forced, in the same batch
    first = s.sample([0, 1], torch.stack([own, lg]))
    assert first[0] == END and first[1] != END
    for _ in range(5):
        assert s.sample([0, 1], torch.stack([lg, lg])) == [4, 4]


def test_logprobs_are_the_raw_log_softmax_sorted_and_only_where_asked():
    lg = logits_batch(3, seed=9)
    s = Sampler(3, V, "cpu")
    s.start(0, params(temperature=0.0, logprobs=5))
    s.start(1, params(temperature=1.0, presence_penalty=2.0, seed=4, logprobs=0))
    s.start(2, params(temperature=1.0, seed=5))
    tokens = s.sample_async([0, 1, 2], lg)
    rows = s.logprobs_async([0, 1, 2], lg, tokens).by_slot()
    assert set(rows) == {0, 1}
    reference = torch.log_softmax(lg, -1)
    for slot in (0, 1):
        assert math.isclose(rows[slot].logprob, float(reference[slot, int(tokens[slot])]), rel_tol=1e-5)
    greedy = rows[0]
    assert len(greedy.top_ids) == 5 and list(greedy.top_logprobs) == sorted(greedy.top_logprobs, reverse=True)
    assert greedy.top_ids[0] == int(tokens[0]) and greedy.top_logprobs[0] == greedy.logprob
    assert rows[1].top_ids == ()
    s.start(0, params(temperature=0.0))
    s.start(1, params(temperature=0.0))
    assert s.logprobs_async([0, 1], lg[:2], s.sample_async([0, 1], lg[:2])) is None


def test_rows_with_nan_or_infinite_logits_are_marked_for_the_host_only():
    from qwen_chat.engine.model.sampling_rules import mark_nonfinite
    from qwen_chat.engine.types import NONFINITE_TOKEN

    logits = torch.randn(5, 1000) * 30
    logits[0, 17] = 1e30  # large but finite: a valid (if odd) distribution
    logits[1, 3] = float("nan")
    logits[2, 999] = float("inf")
    logits[3, 0] = float("-inf")
    tokens = torch.tensor([7, 8, 9, 10, 11])
    assert mark_nonfinite(logits, tokens).tolist() == [7, NONFINITE_TOKEN, NONFINITE_TOKEN, NONFINITE_TOKEN, 11]
    assert tokens.tolist() == [7, 8, 9, 10, 11]  # what the device keeps (and feeds the next step) is untouched
