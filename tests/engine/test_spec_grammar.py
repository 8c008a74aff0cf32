"""Structured output under speculative decoding (tiny model, fp32, CPU): the grammar masks every verified
position of a constrained row (``ConstraintTable.mask_drafts``), so drafts the grammar refuses are never kept
and a constrained reply with speculation equals the same reply without it, token for token."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from qwen_chat.chat_types import CancelToken, ChatMessage, GenerationSettings
from qwen_chat.engine.core.chat_engine import ChatEngine
from qwen_chat.engine.model import spec_step
from qwen_chat.engine.model.mtp import load_mtp_head
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.model.sampling import Sampler
from tests.support.replies import replies_at_once
from tests.support.spy_executor import SpyExecutor

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
ASK = [ChatMessage(role="user", text="Tell me about the sea.")]


class Drafts:
    """A scheduler drafter proposing the entries of ``continuation`` at the request's position (token 0 past
    its end, or for every position without one); keeps the last request it saw (``req.generated``: its
    tokens)."""

    def __init__(self, continuation=()):
        self.continuation = list(continuation)
        self.req = None

    def __call__(self, req, k):
        self.req = req
        done = len(req.generated)
        return [self.continuation[done + j] if done + j < len(self.continuation) else 0 for j in range(k)]


def engine(loaded, k, drafter=None):
    runner = ModelRunner(loaded.model, num_slots=2, max_context=1024, device="cpu")
    if k:
        head = load_mtp_head(loaded.checkpoint, loaded.model.config.text_config, device="cpu", dtype=torch.float32)
        spec_step.attach(runner, head, k=k, max_batch=2)
    spy = SpyExecutor(runner, Sampler(2, runner.vocab_size, "cpu"))
    return ChatEngine(loaded, runner, spy, image_token_budget=64, max_context=1024, max_queue=4, num_slots=2,
                      speculative_tokens=k, drafter=drafter), spy


def greedy(**kw):
    return GenerationSettings.preset(False, **{"temperature": 0.0, "max_new_tokens": 40, **kw})


def answer(eng, settings):
    return list(eng.stream_chat(ASK, settings, CancelToken()))[-1].answer


def test_a_constrained_reply_speculating_on_drafts_the_grammar_refuses_equals_its_plain_reply(tiny_loaded):
    """k = 2.  Drafts from the unconstrained reply (its greedy tokens: what the unmasked logits would keep, but
    mostly not JSON) and drafts from the constrained reply itself (all right): the JSON-schema reply equals the
    one decoded without speculation, and its slot took drafts (not a plain draw) in the speculative steps."""
    plain, _ = engine(tiny_loaded, 0)
    try:
        want = answer(plain, greedy(json_schema=SCHEMA))
    finally:
        plain.close()
    jsonschema.validate(json.loads(want), SCHEMA)

    free = Drafts()
    eng, _ = engine(tiny_loaded, 2, free)
    try:
        free_answer = answer(eng, greedy())
    finally:
        eng.close()
    assert free_answer != want  # (else the drafts below would test nothing)

    def speculating(drafts):
        eng, spy = engine(tiny_loaded, 2, drafts)
        try:
            got = answer(eng, greedy(json_schema=SCHEMA))
            return got, spy, eng.stats()
        finally:
            eng.close()

    wrong = Drafts(free.req.generated)
    got, spy, _ = speculating(wrong)
    assert got == want
    assert any(p.spec_k and p.decode_slots and not p.spec_plain for p in spy.plans)  # its slot took drafts
    got, spy, stats = speculating(Drafts(wrong.req.generated))  # the constrained reply's own tokens
    assert got == want
    assert stats["spec_accepted_total"] > 0


def test_verify_masks_follow_the_drafts_through_the_end_of_the_reasoning_and_leave_the_matcher_as_it_was(
        tiny_loaded):
    """With thinking on a constraint waits for ``</think>``: in a verify window the rows before it are all
    allowed, the row after it is the grammar's first mask, the row after ``{`` the mask after ``{``; a draft the
    grammar refuses leaves the rows after it all allowed; the constraint's state is as before every walk."""
    eng, _ = engine(tiny_loaded, 0)
    try:
        structure = eng.structure
        [c] = structure.constraints_for(GenerationSettings.preset(True, json_schema=SCHEMA), 1)
        tok = structure.tokenizer
        word, brace = tok.encode("sea", add_special_tokens=False)[0], tok.encode("{", add_special_tokens=False)[0]
        think_end = structure.think_end_id
        V = structure.vocab_size

        def window(drafts):
            rows = xgr.allocate_token_bitmask(len(drafts) + 1, V)
            rows.fill_(-1)
            c.draft_rows(drafts, rows, 0)
            return rows

        def grammar_mask(after=()):
            probe = structure.constraints_for(GenerationSettings.preset(False, json_schema=SCHEMA), 1)[0]
            for t in after:
                assert probe.matcher.accept_token(t)
            row = xgr.allocate_token_bitmask(1, V)
            probe.matcher.fill_next_token_bitmask(row, 0)
            return row[0]

        everything = torch.full_like(grammar_mask(), -1)
        rows = window([word, think_end, brace])
        assert torch.equal(rows[0], everything) and torch.equal(rows[1], everything)
        assert torch.equal(rows[2], grammar_mask()) and torch.equal(rows[3], grammar_mask([brace]))
        assert not c.active
        c.accept(think_end)  # the reasoning ended: active, nothing fed yet
        rows = window([word, brace])  # "sea" is not JSON: refused, the row after it unused
        assert torch.equal(rows[0], grammar_mask()) and torch.equal(rows[1], everything)
        rows = window([brace, word])
        assert torch.equal(rows[1], grammar_mask([brace]))
        assert c.active and not c.broken
        again = xgr.allocate_token_bitmask(1, V)
        c.matcher.fill_next_token_bitmask(again, 0)
        assert torch.equal(again[0], grammar_mask())  # the walks rolled the matcher back
    finally:
        eng.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_replies_with_the_random_mtp_head_stay_valid(tiny_loaded, temperature):
    """The tiny checkpoint's random MTP head drafts for a JSON-schema reply and a required tool call (two at
    once, sampled or greedy): both stay valid."""
    from qwen_chat.chat_types import ToolSpec

    tool = ToolSpec("get_time", "", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                     "required": ["zone"]})
    eng, spy = engine(tiny_loaded, 2)
    try:
        settings = dict(temperature=temperature, seed=7, max_new_tokens=60)
        results = replies_at_once(eng, ASK, {"json": greedy(json_schema=SCHEMA, **settings),
                                             "tool": greedy(tools=(tool,), tool_choice="required", **settings)})
        assert eng.stats()["spec_steps_total"] > 0
    finally:
        eng.close()
    jsonschema.validate(json.loads(results["json"].answer), SCHEMA)
    call = results["tool"].tool_calls[0]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("utc", "cet")


def test_tokens_after_the_grammar_ended_are_ignored_not_refused(tiny_loaded, caplog):
    """A speculative run can hold tokens after the reply's stop token (the verify keeps the rows after it
    unmasked; the scheduler drops them): fed to the constraint they leave it as it was, with no warning."""
    eng, _ = engine(tiny_loaded, 0)
    try:
        structure = eng.structure
        [c] = structure.constraints_for(GenerationSettings.preset(False, json_schema=SCHEMA), 1)
        for token in structure.tokenizer.encode('{"n": 3}', add_special_tokens=False):
            c.accept(token)
        assert not c.broken
        c.accept(structure.stop_ids[0])
        assert c.matcher.is_terminated()
        with caplog.at_level("WARNING"):
            eng.structure.table.bind(0, c)
            eng.structure.table.emitted({0: [structure.stop_ids[0], 11, 12]})
        assert not c.broken and "not allowed" not in caplog.text
    finally:
        eng.structure.table.unbind(0)
        eng.close()


def test_the_mtp_head_drafts_only_tokens_the_grammar_allows(tiny_loaded, monkeypatch):
    """With a JSON schema the random MTP head's drafts are masked as they are drawn: every drafted run of an
    active constraint is accepted by (a copy of) its matcher, up to the grammar's end."""
    from qwen_chat.engine.core import constraints

    checked = []
    original = constraints.ConstraintTable.mask_drafts

    def checking(self, slots, logits, drafts):
        for b, s in enumerate(slots):
            c = self._by_slot.get(int(s))
            if c is None or not c.active or c.broken or c.matcher.is_terminated():
                continue
            probe, ok = c.matcher.fork(), True
            for d in drafts[b]:
                if probe.is_terminated():
                    break
                ok = ok and probe.accept_token(int(d))
            checked.append(ok)
        return original(self, slots, logits, drafts)

    monkeypatch.setattr(constraints.ConstraintTable, "mask_drafts", checking)
    eng, _ = engine(tiny_loaded, 2)
    try:
        got = answer(eng, greedy(json_schema=SCHEMA, max_new_tokens=30))
    finally:
        eng.close()
    jsonschema.validate(json.loads(got), SCHEMA)
    assert checked and all(checked), checked
