"""Constrained decoding in the engine on the tiny model (CPU): constrained requests keep the scheduler's
overlap (steps launched ahead) and stay valid, and the rows of one batch do not talk to each other."""
from __future__ import annotations

import json

import jsonschema
import pytest

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings, ToolSpec
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from qwen_chat.engine.core.chat_engine import ChatEngine
from tests.support.replies import replies_at_once
from tests.support.spy_executor import SpyExecutor

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "s": {"type": "string", "maxLength": 4}}, "required": ["n", "s"]}
TIME = ToolSpec("get_time", "", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                 "required": ["zone"]})
USER = [ChatMessage(role="user", text="Tell me about the sea.")]


class OverlapSpy(SpyExecutor):
    """Counts the launches of steps with a constrained slot made while the step before was still in flight."""

    def __init__(self, runner, sampler):
        super().__init__(runner, sampler)
        self.table = None
        self.in_flight = 0
        self.constrained_ahead = 0

    def launch(self, plan):
        slots = set(plan.decode_slots) | {i.slot for i in plan.prefills}
        if self.in_flight and self.table is not None and slots & self.table.slots:  # prefills are bound already
            self.constrained_ahead += 1
        launched = super().launch(plan)
        self.in_flight += 1
        return launched

    def collect(self, launched):
        self.in_flight -= 1
        return super().collect(launched)


@pytest.fixture(scope="module")
def runner_and_sampler(tiny_loaded):
    runner = ModelRunner(tiny_loaded.model, num_slots=3, max_context=1024, device="cpu")
    return runner, Sampler(3, runner.vocab_size, "cpu")


@pytest.fixture
def engine_and_spy(tiny_loaded, runner_and_sampler):
    runner, sampler = runner_and_sampler
    for slot in range(runner.num_slots):
        runner.free(slot)
    spy = OverlapSpy(runner, sampler)
    engine = ChatEngine(tiny_loaded, runner, spy, image_token_budget=64, max_context=1024, max_queue=4,
                        num_slots=3, overlap=True)
    spy.table = engine.structure.table
    yield engine, spy
    engine.close()


def run(engine, settings, messages=USER):
    updates = list(engine.stream_chat(messages, settings, CancelToken()))
    return updates[-1]


def greedy(**kw):
    return GenerationSettings.preset(False, **{"temperature": 0.0, "max_new_tokens": 48, **kw})


@pytest.mark.parametrize("thinking", [False, True])
def test_constrained_steps_are_launched_ahead_and_stay_valid(engine_and_spy, thinking):
    engine, spy = engine_and_spy
    settings = GenerationSettings.preset(thinking, temperature=1.0, seed=5, max_new_tokens=120, json_schema=SCHEMA,
                                         thinking_token_budget=6 if thinking else None)
    last = run(engine, settings)
    jsonschema.validate(json.loads(last.answer), SCHEMA)
    assert spy.constrained_ahead > 5  # the overlap stayed on
    assert engine.structure.table.slots == frozenset()  # unbound when the reply ended


def test_an_unconstrained_reply_is_the_same_beside_constrained_ones(engine_and_spy):
    engine, _ = engine_and_spy
    alone = run(engine, greedy(max_new_tokens=40)).answer
    results = replies_at_once(engine, USER, {"plain": greedy(max_new_tokens=40), "json": greedy(json_schema=SCHEMA),
                                             "tool": greedy(tools=(TIME,), tool_choice="required")})
    assert results["plain"].answer == alone
    jsonschema.validate(json.loads(results["json"].answer), SCHEMA)
    call = results["tool"].tool_calls[0]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("utc", "cet")
    assert results["tool"].finish_reason == "tool_calls"
