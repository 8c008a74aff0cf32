"""Tool-call parsing on scripted model outputs, and the grammars of constrained decoding, without a model.

Scripted replies: token ids (from the real Qwen3.5 tokenizer, built offline once per module) pushed into
request handles and read back through ``stream_replies``, the engine's reply path.  Grammars: random walks
over the tokens each grammar allows (xgrammar's masks) must end in well-formed calls and valid JSON.
"""
from __future__ import annotations

import json
import logging
import random

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from qwen_chat.chat_types import CancelToken, GenerationSettings, ToolSpec
from qwen_chat.engine.model.grammar import Grammars, apply_token_bitmask
from qwen_chat.engine.core.constraints import Constraint, ConstraintTable
from qwen_chat.engine.core.handles import RequestHandle
from qwen_chat.engine.output.replies import stream_replies
from qwen_chat.engine.types import PreparedPrompt
from qwen_chat.engine.text.textstream import ReplyDecoder
from qwen_chat.engine.text.tokenizer_build import build_qwen35_tokenizer
from qwen_chat.engine.text.toolcalls import TOOL_CALL_END_ID, TOOL_CALL_ID, ToolCallSplitter, typed_value

THINK = (248068, 248069)
EOS = (248044, 248046)
TOOLS_IDS = (TOOL_CALL_ID, TOOL_CALL_END_ID)
VOCAB = 248320
WEATHER = ToolSpec("get_weather", "Weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 5},
                   "unit": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"},
                   "spots": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["city", "days"]})
TIME = ToolSpec("get_time", "", {"type": "object", "properties": {}})
PARIS = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"


@pytest.fixture(scope="module")
def tok():
    return build_qwen35_tokenizer()


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, VOCAB, EOS, TOOLS_IDS)


def text(tok, s: str) -> list[int]:
    ids = tok.encode(s, add_special_tokens=False, split_special_tokens=True)
    assert all(i < 248044 for i in ids)
    return ids


def call(tok, body: str = PARIS) -> list[int]:
    return [TOOL_CALL_ID] + text(tok, body) + [TOOL_CALL_END_ID]


def reply(tok, ids, *, thinking=False, finish="stop", tools=(WEATHER, TIME), **settings):
    """Run scripted ids through the engine's reply path: (all updates, the last one)."""
    handle = RequestHandle(1, 3, CancelToken(), lambda: None)
    for t in ids:
        handle.push_token(t)
    handle.finish(finish)
    s = GenerationSettings.preset(thinking, tools=tuple(tools), **settings)
    updates = list(stream_replies([handle], PreparedPrompt(input_ids=torch.zeros(3, dtype=torch.long)), s,
                                  tokenizer=tok, think_ids=THINK, eos_ids=EOS, tool_ids=TOOLS_IDS))
    return updates, updates[-1]


def calls_of(last):
    return [(c.name, json.loads(c.arguments)) for c in last.tool_calls]


def test_one_call_after_text(tok):
    updates, last = reply(tok, text(tok, "Let me check.\n\n") + call(tok))
    assert calls_of(last) == [("get_weather", {"city": "Paris", "days": 3})]
    assert last.finish_reason == "tool_calls" and last.answer == "Let me check."
    assert last.tool_calls[0].id.startswith("call_") and len(last.tool_calls[0].id) == 29
    assert any(u.tool_calls and u.finish_reason is None for u in updates)  # streamed before the end


def test_two_calls_and_parallel_false_keeps_the_first(tok, caplog):
    ids = call(tok) + text(tok, "\n") + call(tok, "\n<function=get_time>\n</function>\n")
    assert [n for n, _ in calls_of(reply(tok, ids)[1])] == ["get_weather", "get_time"]
    assert reply(tok, ids)[1].answer == ""
    with caplog.at_level(logging.INFO):
        last = reply(tok, ids, parallel_tool_calls=False)[1]
    assert [n for n, _ in calls_of(last)] == ["get_weather"] and "parallel_tool_calls" in caplog.text


def test_a_call_inside_the_reasoning_ends_it(tok):
    _, last = reply(tok, text(tok, "I should look it up.") + call(tok), thinking=True)
    assert last.reasoning == "I should look it up." and not last.thinking
    assert calls_of(last) == [("get_weather", {"city": "Paris", "days": 3})]
    assert last.reasoning_tokens == len(text(tok, "I should look it up."))


def test_a_truncated_call_is_plain_text(tok, caplog):
    ids = [TOOL_CALL_ID] + text(tok, "\n<function=get_weather>\n<parameter=city>\nPar")
    with caplog.at_level(logging.WARNING):
        _, last = reply(tok, ids, finish="length")
    assert last.tool_calls == () and last.finish_reason == "length"
    assert last.answer == "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert "ended inside the call" in caplog.text


@pytest.mark.parametrize("body, why", [
    ('{"name": "get_weather", "arguments": {city: Paris}}', "not valid JSON"),
    ("\n<function=get_weather>\nParis\n</function>\n", "not a <parameter"),
    ("\n<function=launch_rockets>\n</function>\n", "unknown function"),
    ("\nget_weather(Paris)\n", "no <function"),
])
def test_malformed_calls_come_back_as_text_with_a_log_line(tok, caplog, body, why):
    with caplog.at_level(logging.WARNING):
        _, last = reply(tok, text(tok, "Hi ") + call(tok, body))
    assert last.tool_calls == () and last.finish_reason == "stop"
    assert last.answer == "Hi <tool_call>" + body + "</tool_call>" and why in caplog.text


def test_json_form_and_typed_values(tok):
    _, last = reply(tok, call(tok, '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'))
    assert calls_of(last) == [("get_weather", {"city": "Rome", "days": 2})]
    body = ("\n<function=get_weather>\n<parameter=city>\n 42 \n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
            "<parameter=hourly>\nTrue\n</parameter>\n<parameter=spots>\n[\"a\", \"b\"]\n</parameter>\n"
            "<parameter=extra>\n{\"x\": 1}\n</parameter>\n</function>\n")
    _, last = reply(tok, call(tok, body))
    # strings stay text (one newline each side belongs to the format), a value that is not its type stays
    # text, undeclared parameters stay text
    assert calls_of(last) == [("get_weather", {"city": " 42 ", "days": "three", "hourly": True, "spots": ["a", "b"],
                                               "extra": '{"x": 1}'})]


def test_typed_value_follows_the_schema():
    assert typed_value("2.5", {"type": "number"}) == 2.5
    assert typed_value("3.0", {"type": "integer"}) == 3
    assert typed_value("null", {"type": ["string", "null"]}) is None
    assert typed_value("null", {"type": "string"}) == "null"
    assert typed_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert typed_value("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 7
    assert typed_value("7", {}) == 7 and typed_value("seven", {}) == "seven"
    assert typed_value("false", {"type": "boolean"}) is False


def test_xml_looking_text_written_by_the_model_is_not_a_call(tok):
    ids = text(tok, "Type <tool_call><function=get_weather></function></tool_call> to call it.")
    _, last = reply(tok, ids)
    assert last.tool_calls == () and last.finish_reason == "stop"
    assert last.answer == "Type <tool_call><function=get_weather></function></tool_call> to call it."


def test_without_tools_the_markers_are_not_text(tok):
    _, last = reply(tok, text(tok, "Hi") + call(tok), tools=())
    assert last.tool_calls == () and "<tool_call>" not in last.answer and "get_weather" in last.answer


def test_splitter_starts_over_at_a_second_open(tok):
    dec = ReplyDecoder(tok, starts_in_reasoning=False)
    split = ToolCallSplitter([WEATHER], lambda t: dec.token_piece(t)[1])
    first = [TOOL_CALL_ID] + text(tok, "\n<function=get_weather>\n")
    out = [t for i in first + call(tok) for t in split.feed(i)]
    assert out == first and len(split.calls) == 1


# ---- grammars -----------------------------------------------------------------------------------------


def allowed_ids(matcher: xgr.GrammarMatcher) -> list[int]:
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(mask)
    return np.nonzero(np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little"))[0].tolist()


def walk(compiled, seed: int, limit: int = 400) -> list[int]:
    """Random tokens among the allowed ones until the grammar ends (the stop token is left out)."""
    rng, matcher, out = random.Random(seed), xgr.GrammarMatcher(compiled), []
    for _ in range(limit):
        token = rng.choice(allowed_ids(matcher))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return out
        out.append(token)
    raise AssertionError("the grammar did not end")


def test_required_calls_grammar_gives_well_formed_calls(tok, grammars):
    compiled = grammars.tool_calls([WEATHER, TIME], parallel=True)
    dec = ReplyDecoder(tok, starts_in_reasoning=False)
    for seed in range(6):
        ids = walk(compiled, seed)
        assert ids[0] == TOOL_CALL_ID and ids[-1] == TOOL_CALL_END_ID
        split = ToolCallSplitter([WEATHER, TIME], lambda t: dec.token_piece(t)[1])
        rest = [t for i in ids for t in split.feed(i)]
        assert split.calls and not [t for t in rest if t != text(tok, "\n")[0]]  # only separators are text
        for c in split.calls:
            jsonschema.validate(json.loads(c.arguments), (WEATHER if c.name == "get_weather" else TIME).parameters)


def test_forced_tool_grammar_is_one_call_of_that_tool(tok, grammars):
    compiled = grammars.tool_calls([WEATHER, TIME], forced="get_time")
    for seed in range(3):  # the same text, however it is split into tokens
        ids = walk(compiled, seed)
        assert tok.decode(ids) == "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"


def test_json_schema_grammar_output_parses_without_control_characters(tok, grammars):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": -2, "maximum": 2},
        "kind": {"enum": ["a", "b"]}, "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"s": {"type": "string", "maxLength": 2}}, "required": ["s"]}}},
        "required": ["name", "n", "kind", "items"]}
    compiled = grammars.json_schema(schema)
    for seed in range(15):
        answer = tok.decode(walk(compiled, seed))
        jsonschema.validate(json.loads(answer), schema)  # json.loads refuses raw control characters
        assert " \n" not in answer and "  " not in answer.replace('"  ', "")


def test_unsupported_schema_is_invalid_input(grammars):
    from qwen_chat.chat_types import InvalidInput

    with pytest.raises(InvalidInput) as info:
        grammars.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}})
    assert info.value.param == "response_format" and "none" in str(info.value)


def test_mask_kernel_matches_xgrammar_and_leaves_other_rows(grammars):
    compiled = grammars.json_schema({"type": "object"})
    logits = torch.randn(2, VOCAB)
    table = ConstraintTable(4, VOCAB, "cpu")
    table.bind(3, Constraint(compiled, after_reasoning=False, think_end_id=THINK[1]))
    masked = table.mask([1, 3], logits)
    ref = logits.clone()
    mask = xgr.allocate_token_bitmask(2, VOCAB)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 1)
    xgr.apply_token_bitmask_inplace(ref, mask, indices=[1])
    assert torch.equal(masked, ref) and torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).sum() == len(allowed_ids(xgr.GrammarMatcher(compiled)))
    assert table.mask([1, 2], logits) is logits  # no constrained row: untouched, no work
    assert torch.equal(apply_token_bitmask(logits, torch.full((2, (VOCAB + 31) // 32), -1, dtype=torch.int32)),
                       logits)


def test_constraint_waits_for_the_end_of_the_reasoning(grammars):
    compiled = grammars.tool_calls([TIME])
    c = Constraint(compiled, after_reasoning=True, think_end_id=THINK[1], opening_ids=(TOOL_CALL_ID,))
    c.accept(100)
    assert not c.active
    c.accept(TOOL_CALL_ID)  # a call inside the reasoning: the grammar starts with it
    assert c.active and not c.broken
    c2 = Constraint(compiled, after_reasoning=True, think_end_id=THINK[1])
    c2.accept(THINK[1])
    assert c2.active and allowed_ids(c2.matcher) == [TOOL_CALL_ID]
    c2.accept(100)  # a token its mask would never allow (e.g. scripted): unconstrained from then on
    assert c2.broken and not c2.active
