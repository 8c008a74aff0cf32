"""Unit tests of the page's kept versions, conversation menu and presets without a browser: ``web.branch_view``,
``web.sidebar``, ``web.presets_view``'s plain functions and the thinking budget on its way to the backend."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from qwen_chat.chat_types import GenerationSettings, InvalidInput
from qwen_chat.history.errors import ConversationNotFound
from qwen_chat.history.store import HistoryStore
from qwen_chat.web.branch_view import BranchActions, branch_rows
from qwen_chat.web.controls import with_session_choices
from qwen_chat.web.handlers import ChatController, Session
from qwen_chat.web.presets_view import parse_budget, restore_settings
from qwen_chat.web.sidebar import ListActions, list_entries, parse_command, parse_tags, tag_choices
from qwen_chat.web.render import chatbot_messages
from qwen_chat.web.stats_view import STATS_CLASS
from tests.support.fake_backend import FakeBackend


@pytest.fixture
def ctl(tmp_path):
    return ChatController(FakeBackend.for_ui(), HistoryStore(tmp_path), save_interval_s=0.05, ui_interval_s=0.0)


def turn(ctl, text, conv_id=None, session=None, settings=None):
    return list(ctl.send("local", conv_id, text, [], "", settings or GenerationSettings.preset(True),
                         session or Session()))[-1].conv_id


def messages_text(message: dict) -> str:
    return " ".join(part.get("text", "") for part in message["content"])


def test_regenerate_keeps_the_earlier_reply_and_the_page_can_switch_back(ctl):
    conv_id = turn(ctl, "hello")
    first_stats = ctl.store.user("local").load(conv_id).messages[1].stats
    assert first_stats and first_stats["completion_tokens"] > 0
    ctl.backend.answer = "second answer"
    list(ctl.regenerate("local", conv_id, "", GenerationSettings.preset(False), Session()))
    conv = ctl.store.user("local").load(conv_id)
    rows = branch_rows(conv)
    # the regenerated reply (no thinking) fills two Chatbot positions, its answer and its statistics line; the
    # tools go under the answer; it is version 2 of 2
    assert [(r["row"], r["role"], r["shown"], r["count"]) for r in rows] == [(0, "user", 1, 1),
                                                                          (1, "assistant", 2, 2)]
    assert STATS_CLASS in messages_text(chatbot_messages(conv.messages, None)[2])
    actions = BranchActions(ctl)
    command = json.dumps({"op": "switch", "msg": rows[1]["id"], "step": -1})
    messages, cid, _ = actions.run("local", conv_id, command)
    # thinking on for the first reply: reasoning, answer and statistics line; the kept version kept its statistics
    assert cid == conv_id and "You said: hello" in messages_text(messages[-2])
    assert STATS_CLASS in messages_text(messages[-1])
    assert ctl.store.user("local").load(conv_id).messages[1].stats == first_stats
    rows = branch_rows(ctl.store.user("local").load(conv_id))
    assert [(r["row"], r["shown"], r["count"]) for r in rows] == [(0, 1, 1), (2, 1, 2)]  # under the answer

    history = ctl.store.user("local")
    history.append_message(conv_id, role="user", text="and now?")
    reply = history.append_message(conv_id, role="assistant", text="", status="streaming")
    with pytest.raises(InvalidInput, match="still being written"):  # no switching while a reply is written
        actions.run("local", conv_id, command)
    history.update_message(conv_id, reply, status="complete")
    for bad in ("", "{", json.dumps({"op": "switch", "msg": rows[1]["id"], "step": 5}),
                json.dumps({"op": "drop", "msg": "x"}), "[1]"):
        with pytest.raises(InvalidInput):
            actions.run("local", conv_id, bad)
    with pytest.raises(ConversationNotFound):  # another user's conversation is not found
        actions.run("bob", conv_id, command)


def test_fork_from_the_page_opens_a_new_conversation(ctl):
    conv_id = turn(ctl, "first")
    turn(ctl, "second", conv_id)
    conv = ctl.store.user("local").load(conv_id)
    messages, new_id, notice = BranchActions(ctl).run(
        "local", conv_id, json.dumps({"op": "fork", "msg": conv.messages[1].id}))
    assert new_id != conv_id and "Forked" in notice and len(messages) == 4  # user, thought, answer, statistics
    assert ctl.store.user("local").load(new_id).messages[1].stats == conv.messages[1].stats  # the fork keeps them
    assert [m.text for m in ctl.store.user("local").load(new_id).messages][0] == "first"


def test_the_list_puts_pinned_first_and_filters_by_tag(ctl):
    history = ctl.store.user("local")
    ids = [turn(ctl, title) for title in ("older", "middle", "newest")]
    actions = ListActions(ctl)
    assert actions.run("local", {"op": "pin", "conv": ids[0], "pinned": True})[0] == "Pinned."
    assert actions.run("local", {"op": "tags", "conv": ids[1], "tags": "Work, travel ,work"})[0] == \
        "Tags: Work, travel"
    entries = ctl.conversation_choices("local")
    assert [cid for _, cid in entries] == [ids[0], ids[2], ids[1]]
    assert entries[0][0].startswith("\u2605 older · ") and entries[2][0].endswith(" · tags: Work, travel")
    assert [cid for _, cid in ctl.conversation_choices("local", tag="work")] == [ids[1]]
    assert tag_choices(history.list()) == [("All conversations", ""), ("travel", "travel"), ("Work", "Work")]
    assert actions.run("local", {"op": "rename", "conv": ids[2], "title": "  brand   new "})[0] == \
        "Renamed to: brand new"
    assert history.load(ids[2]).title == "brand new"
    assert actions.run("local", {"op": "export", "conv": ids[2]})[1].endswith(".zip")
    with pytest.raises(ConversationNotFound):
        actions.run("mallory", {"op": "delete", "conv": ids[2]})
    reply = history.append_message(ids[2], role="assistant", text="", status="streaming")
    with pytest.raises(InvalidInput, match="press Stop first"):
        actions.run("local", {"op": "delete", "conv": ids[2]})
    history.update_message(ids[2], reply, status="stopped")
    assert actions.run("local", {"op": "delete", "conv": ids[2]})[0] == "Conversation deleted."
    assert len(history.list()) == 2
    for bad in ("x" * 31, ",".join("t%d" % i for i in range(11))):
        with pytest.raises(InvalidInput):
            parse_tags(bad)
    with pytest.raises(InvalidInput):
        parse_command('{"op": "pin"}')
    with pytest.raises(InvalidInput, match="unknown"):
        actions.run("local", {"op": "explode", "conv": ids[0]})


def test_list_entries_keep_each_group_newest_first():
    s = [SimpleNamespace(id=str(i), title=f"t{i}", updated="2026-12-01T10:00:00+00:00", pinned=i in (1, 3),
                         tags=()) for i in range(4)]
    assert [cid for _, cid in list_entries(s)] == ["1", "3", "0", "2"]


def test_thinking_budget_box_and_saved_settings():
    assert parse_budget("") is None and parse_budget(" 128 ") == 128 and parse_budget(0) == 0
    for bad in ("abc", "1.5", "-1", "100000"):
        with pytest.raises(InvalidInput, match="thinking budget"):
            parse_budget(bad)
    old = {"system_prompt": "Be brief.", "temperature": 0.7, "enable_thinking": False, "seed": 5, "top_k": True}
    assert restore_settings(old) == {"system_prompt": "Be brief.", "temperature": 0.7, "enable_thinking": False,
                                     "thinking_token_budget": None}
    assert restore_settings(None) == {}
    settings = with_session_choices(GenerationSettings.preset(True), Session(thinking_budget=64))
    assert settings.thinking_token_budget == 64
    assert with_session_choices(GenerationSettings.preset(True), Session()).thinking_token_budget is None


def test_budget_and_preset_reach_the_backend_and_are_saved_with_the_chat(ctl):
    session = Session(thinking_budget=32, preset="Short")
    conv_id = turn(ctl, "think briefly", session=session)
    assert ctl.backend.calls[-1].settings.thinking_token_budget == 32
    saved = ctl.store.user("local").load(conv_id).settings
    assert saved["thinking_token_budget"] == 32 and saved["preset"] == "Short"


def test_switching_back_sends_the_same_prompt_as_before_so_the_cache_can_reuse_it(ctl):
    conv_id = turn(ctl, "first question")
    turn(ctl, "second question", conv_id)
    before = ctl.backend.calls[-1].messages  # the prompt of the second turn on the first version
    settings = GenerationSettings.preset(True)
    list(ctl.edit("local", conv_id, 0, "first question, reworded", "", settings, Session()))
    history = ctl.store.user("local")
    first = history.load(conv_id).messages[0]
    BranchActions(ctl).run("local", conv_id, json.dumps({"op": "switch", "msg": first.id, "step": -1}))
    turn(ctl, "third question", conv_id)
    after = ctl.backend.calls[-1].messages
    # the same messages, in the same order, as the earlier prompt: the same token ids, which is what the
    # engine's conversation cache matches (docs/conversation-cache.md)
    assert after[: len(before)] == before and [m.text for m in after][-1] == "third question"
    assert "reworded" not in " ".join(m.text for m in after)  # the other version is never sent
