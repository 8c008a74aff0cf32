"""ChatEngine end to end on the built-in tiny model (random weights, real Qwen3.5 structure and tokenizer), CPU.

Covers the engine and its continuous batching at the service level: greedy determinism, the token limit, Stop
and a closed stream freeing the slot, image + text prompts, concurrent requests that share decode steps without
cross-talk, Busy, seeded sampling, the reasoning/answer split at ``</think>`` (also for a reply cut off while
thinking) and stop strings.  Most tests wait for every step (``overlap=False``: the scripted replies rewrite
``execute``); ``test_production_default_overlap_gives_the_same_replies`` runs the production default, steps
launched ahead.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from qwen_chat.chat_types import Busy, CancelToken, ChatMessage, GenerationSettings, InvalidInput, NotReady
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.core.chat_engine import ChatEngine
from qwen_chat.engine.output.replies import THINKING_CUT_NOTICE
from tests.support.spy_executor import SpyExecutor
from tests.support.waiting import wait_until

IMAGES = Path(__file__).parents[1] / "fixtures" / "images"
MAX_CONTEXT = 2048


@pytest.fixture(scope="module")
def runner_and_sampler(tiny_loaded):
    runner = ModelRunner(tiny_loaded.model, num_slots=2, max_context=MAX_CONTEXT, device="cpu")
    return runner, Sampler(2, runner.vocab_size, "cpu")


@pytest.fixture
def make_engine(tiny_loaded, runner_and_sampler):
    engines = []

    def make(num_slots=2, max_queue=4, gate=None, max_context=MAX_CONTEXT, overlap=False):
        runner, sampler = runner_and_sampler
        for slot in range(runner.num_slots):
            runner.free(slot)
        ex = SpyExecutor(runner, sampler, gate=gate)
        engine = ChatEngine(tiny_loaded, runner, ex, image_token_budget=64, max_context=max_context,
                            max_queue=max_queue, num_slots=num_slots, overlap=overlap)  # scripts rewrite execute()
        engines.append(engine)
        return engine, ex

    yield make
    for e in engines:
        e.close()


@pytest.fixture
def engine(make_engine):
    return make_engine()[0]


def user(text, *images):
    return [ChatMessage(role="user", text=text, images=tuple(str(IMAGES / i) for i in images))]


def greedy(thinking=False, **kw):
    return GenerationSettings.preset(thinking, **{"temperature": 0.0, "max_new_tokens": 64, **kw})


def run(engine, messages, settings, cancel=None):
    updates = list(engine.stream_chat(messages, settings, cancel or CancelToken()))
    assert updates and updates[-1].finish_reason is not None
    assert all(u.finish_reason is None for u in updates[:-1])
    return updates


def test_greedy_is_deterministic_and_deltas_add_up(engine):
    a = run(engine, user("Tell me about the sea."), greedy())
    b = run(engine, user("Tell me about the sea."), greedy())
    assert a[-1].answer and a[-1].answer == b[-1].answer
    assert a[-1].completion_tokens == b[-1].completion_tokens
    assert "".join(u.answer_delta for u in a) == a[-1].answer
    assert a[-1].prompt_tokens > 5 and a[-1].ttft_s is not None and a[-1].ttft_s > 0


def test_max_new_tokens_is_honoured(engine):
    last = run(engine, user("Count to one hundred."), greedy())[-1]
    assert last.finish_reason == "length"
    assert last.completion_tokens == 64


def stop_after_three_updates(engine):
    """Stream a long reply and press Stop (cancel its token) after its third update; returns the updates."""
    cancel = CancelToken()
    updates = []
    for u in engine.stream_chat(user("Write a long story."), greedy(max_new_tokens=8192), cancel):
        updates.append(u)
        if len(updates) == 3:
            cancel.cancel()
    return updates


def test_stop_mid_stream_frees_slot_and_next_request_works(make_engine):
    engine, ex = make_engine(num_slots=1, max_queue=1)
    updates = stop_after_three_updates(engine)
    assert updates[-1].finish_reason == "cancelled"
    assert updates[-1].completion_tokens < 100
    wait_until(lambda: engine.stats()["running"] == 0)
    assert engine.stats()["finished_cancelled_total"] == 1
    last = run(engine, user("Hi"), greedy())[-1]
    assert last.finish_reason in ("stop", "length") and last.completion_tokens > 0


def test_closing_the_stream_cancels_generation(make_engine):
    engine, ex = make_engine(num_slots=1, max_queue=1)
    stream = engine.stream_chat(user("Write a long story."), greedy(max_new_tokens=8192), CancelToken())
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # what Gradio/Starlette do when the user presses Stop or the tab goes away
    wait_until(lambda: any(p.free_slots == [0] for p in ex.plans))  # the step that releases the slot
    steps = len(ex.plans)
    assert engine.stats()["running"] == 0 and engine.stats()["finished_cancelled_total"] == 1
    assert engine.stats()["generated_tokens_total"] < 100
    time.sleep(0.2)
    assert len(ex.plans) == steps  # nothing runs after the cancel
    # an iterator dropped without ever being started is cancelled too
    engine.stream_chat(user("Write a long story."), greedy(max_new_tokens=8192), CancelToken())
    wait_until(lambda: engine.stats()["finished_cancelled_total"] == 2 and engine.stats()["running"] == 0)


def test_image_and_text_prompt(engine):
    text_only = engine.prepare(user("What animal is this?"), greedy())
    with_image = engine.prepare(user("What animal is this?", "chelsea.png"), greedy())
    grid = with_image.image_grid_thw
    assert grid is not None and grid.shape == (1, 3)
    visual_tokens = int(grid.prod()) // 4  # 2x2 spatial merge (docs/facts.md, "Chat template behaviour")
    assert 0 < visual_tokens <= 64  # image_token_budget=64
    # the image adds <|vision_start|>, one pad per visual token, <|vision_end|>
    assert with_image.num_tokens == text_only.num_tokens + visual_tokens + 2
    a = run(engine, user("What animal is this?", "chelsea.png"), greedy())[-1]
    b = run(engine, user("What animal is this?"), greedy())[-1]
    assert a.prompt_tokens == with_image.num_tokens
    assert a.finish_reason in ("stop", "length") and a.completion_tokens > 0
    assert a.answer != b.answer  # the image really reached the model


def test_concurrent_requests_batch_together_without_cross_talk(make_engine):
    s1 = GenerationSettings.preset(False, seed=1, max_new_tokens=64)
    s2 = GenerationSettings.preset(False, seed=2, max_new_tokens=64)
    m1, m2 = user("First question"), user("Another, longer second question")
    engine, ex = make_engine()
    solo1, solo2 = run(engine, m1, s1)[-1], run(engine, m2, s2)[-1]
    gate = threading.Event()
    engine, ex = make_engine(gate=gate)
    results = run_two_at_once(engine, ex, gate, (m1, s1), (m2, s2))
    assert (results[1].answer, results[1].completion_tokens) == (solo1.answer, solo1.completion_tokens)
    assert (results[2].answer, results[2].completion_tokens) == (solo2.answer, solo2.completion_tokens)
    assert results[1].answer != results[2].answer
    both = [p for p in ex.plans if len(p.decode_slots) == 2]
    assert both, "the two requests never shared a decode step"
    assert any(p.prefills and p.decode_slots for p in ex.plans), "request 2 did not join a running batch"
    assert engine.stats()["max_decode_batch"] == 2
    assert engine.stats()["step_seconds_total"] > 0  # engine busy time, exported on /metrics


def run_two_at_once(engine, ex, gate, first, second):
    """Stream ``first`` ((messages, settings)); once its prefill step holds at ``gate``, submit ``second`` and open
    the gate.  Returns {1: last update of first, 2: last update of second}."""
    g1 = engine.stream_chat(*first, CancelToken())
    results = {}
    t = threading.Thread(target=lambda: results.setdefault(1, list(g1)[-1]))
    t.start()
    assert ex.step_started.wait(30)  # request 1 is inside its prefill step
    g2 = engine.stream_chat(*second, CancelToken())
    gate.set()
    results[2] = list(g2)[-1]
    t.join(60)
    return results


def test_production_default_overlap_gives_the_same_replies(make_engine):
    """The production default (``overlap=None``: on for a ``LocalExecutor``, each step launched before the
    previous step's tokens are back) gives the replies of the engine that waits for every step: greedy and
    seeded text, the token limit, two requests sharing decode steps, and Stop freeing the slot."""
    s1 = GenerationSettings.preset(False, seed=1, max_new_tokens=64)
    m1, m2 = user("Tell me about the sea."), user("Another, longer second question")
    waited, _ = make_engine()
    ref_greedy, ref_seeded = run(waited, m1, greedy())[-1], run(waited, m2, s1)[-1]
    waited.close()  # its scheduler thread has stopped before the next engine shares the runner
    gate = threading.Event()
    engine, ex = make_engine(gate=gate, overlap=None)
    assert engine.scheduler.overlap
    results = run_two_at_once(engine, ex, gate, (m1, greedy()), (m2, s1))
    for got, ref in ((results[1], ref_greedy), (results[2], ref_seeded)):
        assert (got.answer, got.completion_tokens, got.finish_reason) == (
            ref.answer, ref.completion_tokens, ref.finish_reason)
    assert ref_greedy.finish_reason == "length" and ref_greedy.completion_tokens == 64
    assert any(len(p.decode_slots) == 2 for p in ex.plans), "the two requests never shared a decode step"
    assert all(p.tokens_on_device for p in ex.plans)  # every step fed the tokens sampled on the device
    again = run(engine, m1, greedy())
    assert again[-1].answer == ref_greedy.answer and "".join(u.answer_delta for u in again) == again[-1].answer
    updates = stop_after_three_updates(engine)
    assert updates[-1].finish_reason == "cancelled" and updates[-1].completion_tokens < 100
    wait_until(lambda: engine.stats()["running"] == 0)
    assert run(engine, m1, greedy())[-1].answer == ref_greedy.answer


def test_queue_full_raises_busy(make_engine):
    gate = threading.Event()
    engine, ex = make_engine(num_slots=1, max_queue=1, gate=gate)
    first = engine.stream_chat(user("one"), greedy(), CancelToken())
    second = engine.stream_chat(user("two"), greedy(), CancelToken())
    with pytest.raises(Busy, match=r"busy, 1 requests queued, try again"):
        engine.stream_chat(user("three"), greedy(), CancelToken())
    gate.set()
    assert list(first)[-1].finish_reason in ("stop", "length")
    assert list(second)[-1].finish_reason in ("stop", "length")


def test_seeded_sampling_is_reproducible(engine):
    s = GenerationSettings.preset(False, seed=1234, max_new_tokens=64, temperature=1.0)
    a = run(engine, user("Say something"), s)[-1]
    b = run(engine, user("Say something"), s)[-1]
    c = run(engine, user("Say something"), GenerationSettings.preset(False, seed=99, max_new_tokens=64,
                                                                      temperature=1.0))[-1]
    assert a.answer == b.answer and a.completion_tokens == b.completion_tokens
    assert c.answer != a.answer


def test_n_choices_share_one_prefill_and_equal_their_solo_replies(make_engine):
    """n = 3 on 2 slots: choices 0 and 1 share a prefill (the runner copies the slot), choice 2 gets its own;
    choice i is the reply a request with seed + i alone gets, so copying the slot state changes nothing."""
    engine, ex = make_engine()
    settings = GenerationSettings.preset(False, seed=21, max_new_tokens=12, temperature=1.0)
    lasts = {}
    for u in engine.stream_chat(user("Say something"), replace(settings, n=3), CancelToken()):
        if u.finish_reason is not None:
            lasts[u.index] = u
    assert sorted(lasts) == [0, 1, 2]
    assert [len(item.copies) for plan in ex.plans for item in plan.prefills] == [1, 0]
    for i in range(3):
        alone = run(engine, user("Say something"), replace(settings, seed=21 + i))[-1]
        assert (lasts[i].answer, lasts[i].completion_tokens) == (alone.answer, alone.completion_tokens)
    assert lasts[0].answer != lasts[1].answer


def test_invalid_settings_raise_before_streaming(engine):
    with pytest.raises(InvalidInput, match="top_p"):
        engine.stream_chat(user("hi"), GenerationSettings(top_p=0.0), CancelToken())
    with pytest.raises(InvalidInput, match="max_new_tokens"):
        engine.stream_chat(user("hi"), GenerationSettings(max_new_tokens=0), CancelToken())
    assert engine.stats()["requests_total"] == 0


def test_thinking_cut_off_by_token_limit_stays_reasoning(engine):
    last = run(engine, user("Prove there are infinitely many primes."), greedy(thinking=True))[-1]
    assert last.finish_reason == "length"
    assert last.reasoning and last.answer == "" and last.thinking
    assert THINKING_CUT_NOTICE in last.notice


def test_thinking_off_is_all_answer(engine):
    updates = run(engine, user("Hello"), greedy(thinking=False))
    assert updates[-1].reasoning == "" and updates[-1].answer
    assert not any(u.thinking for u in updates)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_reasoning_and_answer_split_at_think_end(make_engine, tiny_loaded):
    engine, ex = make_engine()
    tok = tiny_loaded.tokenizer
    msgs = user("What is 1+1?")
    n = engine.prepare(msgs, greedy(thinking=True)).num_tokens
    ex.script[n] = (_ids(tok, "Simple sum.\n") + [tok.convert_tokens_to_ids("</think>")]
                    + _ids(tok, "\n\n2") + [tok.convert_tokens_to_ids("<|im_end|>")])
    updates = run(engine, msgs, greedy(thinking=True))
    last = updates[-1]
    assert (last.reasoning, last.answer, last.finish_reason) == ("Simple sum.", "2", "stop")
    assert "</think>" not in last.answer and not last.thinking and not last.notice
    assert updates[0].thinking and updates[0].answer == ""
    assert last.completion_tokens == len(ex.script[n])  # the im_end that ended the reply counts, as in OpenAI


def test_stop_string_cuts_the_answer(make_engine, tiny_loaded):
    engine, ex = make_engine()
    tok = tiny_loaded.tokenizer
    msgs = user("List")
    n = engine.prepare(msgs, greedy()).num_tokens
    ex.script[n] = _ids(tok, "one, two, three, four, five") + [tok.convert_tokens_to_ids("<|im_end|>")]
    updates = run(engine, msgs, greedy(stop=("three",)))
    assert updates[-1].answer == "one, two, " and updates[-1].finish_reason == "stop"
    assert "".join(u.answer_delta for u in updates) == "one, two, "
    assert all("thr" not in u.answer for u in updates)
    wait_until(lambda: engine.stats()["running"] == 0)


def test_top_k_1_equals_greedy(engine):
    """top_k=1 keeps only the most likely token, so at any temperature (and any top_p) it is greedy."""
    g = run(engine, user("Name a colour."), greedy())[-1]
    k1 = run(engine, user("Name a colour."),
             GenerationSettings.preset(False, temperature=1.5, top_k=1, top_p=0.1, presence_penalty=0.0,
                                       max_new_tokens=64, seed=5))[-1]
    assert k1.answer == g.answer and k1.completion_tokens == g.completion_tokens


def test_context_policy_notice_and_clamped_reply(make_engine):
    engine, _ = make_engine(max_context=300)
    long_turn = "word " * 60
    msgs = []
    for i in range(4):
        msgs += [ChatMessage(role="user", text=f"{i} {long_turn}"), ChatMessage(role="assistant", text=long_turn)]
    msgs.append(ChatMessage(role="user", text="And now?"))
    prepared = engine.prepare(msgs, greedy(max_new_tokens=200))
    assert "oldest turn" in prepared.notice and "left out of the prompt" in prepared.notice  # whole turns dropped
    updates = run(engine, msgs, greedy(max_new_tokens=200))
    assert all(u.notice.startswith(prepared.notice) for u in updates)
    last = updates[-1]
    assert last.prompt_tokens == prepared.num_tokens
    assert last.prompt_tokens + last.completion_tokens <= 300
    assert last.completion_tokens <= prepared.max_new_tokens


def test_self_check_and_health(engine):
    assert engine.health()["ok"] is False and "self-check not run" in engine.health()["reason"]
    assert engine.self_check() is True
    h = engine.health()
    assert h["ok"] is True and h["self_check"] == "passed" and h["active"] == 0


def test_engine_failure_mid_stream_ends_with_error_not_exception(make_engine):
    engine, ex = make_engine()
    assert engine.self_check()
    original = ex.execute
    before = len(ex.plans)  # the self-check's steps

    def failing(plan):
        if plan.decode_slots and len(ex.plans) - before > 2:
            ex.plans.append(plan)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return original(plan)

    ex.execute = failing
    updates = run(engine, user("Tell me a story"), greedy())
    last = updates[-1]
    assert last.finish_reason == "error"
    assert last.notice.startswith("generation failed: the engine failed while generating (RuntimeError)")
    assert "illegal memory access" not in last.notice  # internals stay in the server log
    health = engine.health()
    assert health["ok"] is False and "illegal memory access" in health["reason"]
    assert engine.stats()["finished_error_total"] == 1


def test_exit_process_soon_exits_with_code_1():
    """What build_engine wires to an engine failure: the process ends non-zero so that Supervisor restarts it."""
    code = ("import time; from qwen_chat.lifecycle import exit_process_soon; "
            "exit_process_soon('simulated failure', 0.2); time.sleep(60)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert "simulated failure" in done.stderr and "exiting with code 1" in done.stderr


def test_health_reports_a_stuck_step(make_engine):
    gate = threading.Event()
    gate.set()
    engine, ex = make_engine(gate=gate)
    assert engine.self_check()
    gate.clear()  # the next step hangs, as a wedged device would
    stream = engine.stream_chat(user("hi"), greedy(), CancelToken())
    wait_until(lambda: engine.stats()["step_running_s"] > 0)
    assert engine.health()["ok"] is True  # far below stuck_after_s
    engine.stuck_after_s = 0.0
    health = engine.health()
    assert health["ok"] is False and "engine stuck" in health["reason"]
    gate.set()
    assert list(stream)[-1].finish_reason in ("stop", "length")
    wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["step_running_s"] == 0.0)
    engine.stuck_after_s = 600.0
    assert engine.health()["ok"] is True


def test_failed_self_check_refuses_requests_with_not_ready(make_engine):
    engine, ex = make_engine()

    def broken(plan):
        raise RuntimeError("device lost")

    ex.execute = broken
    assert engine.self_check() is False
    assert engine.health()["ok"] is False and "self-check failed" in engine.health()["reason"]
    with pytest.raises(NotReady, match="self-check"):
        engine.stream_chat(user("hi"), greedy(), CancelToken())
