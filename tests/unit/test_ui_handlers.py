"""Unit tests of ``qwen_chat.web.handlers`` and ``qwen_chat.web.render`` (no server, no browser): safe rendering,
blank detection, settings, and the controller's saving discipline (streaming saves, stop, crash, interrupted
replies, limits)."""
from __future__ import annotations

import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

from qwen_chat.chat_types import GenerationSettings, InvalidImage, InvalidInput, StreamUpdate, is_blank
from qwen_chat.history.store import HistoryStore
from qwen_chat.web.controls import DEMO_MAX_NEW_TOKENS, build_settings, page_defaults, parse_seed, preset_values
from qwen_chat.web.handlers import RUNNING_MARK, ChatController, Session
from qwen_chat.web.render import chatbot_messages, conversation_label, plain_text, safe_markdown, stored_index
from tests.support.fake_backend import FakeBackend

CHELSEA = Path(__file__).parents[1] / "fixtures" / "images" / "chelsea.png"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<img src=x onerror=alert(1)>", "&lt;img src=x onerror=alert(1)>"),
        ("<script>alert('hi')</script>", "&lt;script>alert('hi')&lt;/script>"),
        ("AT&T and &lt;", "AT&amp;T and &amp;lt;"),
        ("costs $5 and $10", "costs $5 and $10"),
        ("[x](javascript:alert(1))", "[x]\\(javascript:alert(1))"),
        ("[x]( JavaScript:alert(1))", "[x]\\( JavaScript:alert(1))"),
        ("[ok](https://example.com)", "[ok](https://example.com)"),
        ("![t](http://evil.example/pixel.png)", "!\\[t](http://evil.example/pixel.png)"),
        ("use `<b>` here", "use `<b>` here"),  # code spans are escaped by the renderer itself
        ("a `` x`<i>` `` b <i>", "a `` x`<i>` `` b &lt;i>"),
        ("unclosed ` <b>", "unclosed ` &lt;b>"),
        ("```html\n<script>x</script>\n```\n<b>", "```html\n<script>x</script>\n```\n&lt;b>"),
        ("~~~\n<a>\n~~~~\n<a>", "~~~\n<a>\n~~~~\n&lt;a>"),
        ("```\n<still code>", "```\n<still code>"),  # an unclosed fence runs to the end
        ("笑脸 😊 c.ⱯI 👨‍👩‍👧", "笑脸 😊 c.ⱯI 👨‍👩‍👧"),
    ],
)
def test_safe_markdown(text, expected):
    assert safe_markdown(text) == expected
    assert plain_text(expected) == text  # what the Chatbot's edit box holds reads back as typed


@pytest.mark.parametrize("text,blank", [(None, True), ("", True), ("  \n\t", True), ("\u200b", True),
                                        ("\u200b\u200d\ufeff \u2060", True), (" a ", False), ("0", False),
                                        ("\u200bx", False)])
def test_is_blank(text, blank):
    assert is_blank(text) is blank


def test_demo_model_starts_without_thinking_and_with_short_replies():
    demo, real = page_defaults(True), page_defaults(False)
    assert (demo.enable_thinking, demo.max_new_tokens, demo.temperature) == (False, DEMO_MAX_NEW_TOKENS, 0.7)
    assert DEMO_MAX_NEW_TOKENS == 256
    assert (real.enable_thinking, real.max_new_tokens) == (True, GenerationSettings().max_new_tokens)
    assert real.temperature == 1.0


def test_sidebar_label_has_the_local_date():
    from types import SimpleNamespace

    now = datetime(2025, 3, 12, 18, 0).astimezone()

    def label(when: datetime) -> str:
        return conversation_label(SimpleNamespace(title="Same  title\n", updated=when.isoformat()), now=now)

    assert label(datetime(2025, 3, 12, 9, 5).astimezone()) == "Same title · today 09:05"
    assert label(datetime(2025, 3, 11, 23, 59).astimezone()) == "Same title · yesterday 23:59"
    assert label(datetime(2025, 1, 3, 7, 0).astimezone()) == "Same title · 3 Jan 07:00"
    assert label(datetime(2024, 12, 30, 7, 0).astimezone()) == "Same title · 30 Dec 2024"
    utc = datetime(2025, 3, 12, 9, 5, tzinfo=timezone.utc)  # stored times are UTC; shown in local time
    assert label(utc).endswith(utc.astimezone().strftime("%H:%M"))
    long = conversation_label(SimpleNamespace(title="x" * 80, updated="not a time"))
    assert long == "x" * 57 + "..."


def test_presets_follow_the_thinking_switch():
    assert preset_values(True) == (1.0, 0.95, 20, 1.5)
    assert preset_values(False) == (0.7, 0.8, 20, 1.5)


def test_build_settings_accepts_slider_edges_and_rejects_outside():
    s = build_settings(False, 64.0, 0.0, 0.1, 1.0, 0.0, "")
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.enable_thinking) == (64, 0.0, 0.1, 1, None,
                                                                                               False)
    assert isinstance(s.max_new_tokens, int) and isinstance(s.top_k, int)
    assert build_settings(True, 8192, 1.5, 1.0, 100, 2.0, 42.0).seed == 42
    with pytest.raises(InvalidInput, match="top_p"):
        build_settings(True, 2048, 1.0, 0.0, 20, 1.5, None)  # out of range: refused, never silently changed
    with pytest.raises(InvalidInput, match="top_k"):
        build_settings(True, 2048, 1.0, 0.9, 0, 1.5, None)
    with pytest.raises(InvalidInput, match="max_new_tokens"):
        build_settings(True, 8193, 1.0, 0.9, 20, 1.5, None)
    with pytest.raises(InvalidInput, match="number"):
        build_settings(True, None, 1.0, 0.9, 20, 1.5, None)


def test_parse_seed():
    assert parse_seed(None) is None and parse_seed("  ") is None
    assert parse_seed(7) == 7 and parse_seed("12") == 12 and parse_seed(3.0) == 3
    for bad in ("abc", 1.5, float("nan")):
        with pytest.raises(InvalidInput, match="seed"):
            parse_seed(bad)


@pytest.fixture
def ctl(tmp_path):
    return ChatController(FakeBackend.for_ui(), HistoryStore(tmp_path), save_interval_s=0.05, ui_interval_s=0.0)


def run_turn(ctl, text, conv_id=None, files=(), session=None, settings=None):
    views = list(ctl.send("local", conv_id, text, list(files), "", settings or GenerationSettings.preset(True),
                          session or Session()))
    return views


def test_reply_is_saved_while_it_streams(ctl):
    """kill -9 mid-stream loses at most ``save_interval_s``: the disk holds the partial reply as streaming."""
    ctl.backend.step_delay_s = 0.03
    ctl.backend.answer = " ".join(f"w{i}" for i in range(60))
    history = ctl.store.user("local")
    seen = []
    for view in ctl.send("local", None, "go", [], "", GenerationSettings.preset(False), Session()):
        if view.conv_id and not view.done:
            msgs = history.load(view.conv_id).messages
            if len(msgs) == 2:
                seen.append((msgs[1].status, msgs[1].text))
    partial = [t for status, t in seen if status == "streaming" and t.startswith("w0 w1")]
    assert any(len(t) < len(ctl.backend.answer) for t in partial)
    assert history.load(view.conv_id).messages[1].status == "complete"


def test_closing_the_stream_leaves_the_reply_running_to_its_end(ctl):
    """New chat or another conversation closes the event showing a reply: the reply goes on and is saved
    complete, the sidebar marks its conversation meanwhile, and reopening it shows it live."""
    ctl.backend.step_delay_s = 0.01
    ctl.backend.answer = " ".join(f"w{i}" for i in range(150))
    session = Session()
    gen = ctl.send("local", None, "long story", [], "", GenerationSettings.preset(False), session)
    view = None
    for view in gen:
        if view.conv_id and "w5" in str(view.messages):
            break
    gen.close()  # what Gradio does when New chat / opening another conversation cancels the event
    labels = dict((cid, label) for label, cid in ctl.conversation_choices("local"))
    assert labels[view.conv_id].endswith(RUNNING_MARK)
    shown = ctl.open("local", view.conv_id)[0]  # reopened while it runs: live, not "interrupted"
    assert "interrupted" not in str(shown) and shown[-1]["metadata"] == {"status": "done"}
    assert ctl.live.wait_idle(30)
    call = ctl.backend.calls[-1]
    assert call.finish_reason == "stop" and call.steps == 150
    reply = ctl.store.user("local").load(view.conv_id).messages[-1]
    assert reply.status == "complete" and reply.text.endswith("w149")
    assert reply.stats["completion_tokens"] == 150 and reply.stats["prompt_tokens"] == call.prompt_tokens
    assert not ctl.conversation_choices("local")[0][0].endswith(RUNNING_MARK)
    assert session.cancel is None and ctl.backend.active == 0


def test_a_closed_tab_stops_its_replies_and_saves_them_stopped(ctl):
    ctl.backend.step_delay_s = 0.01
    ctl.backend.answer = " ".join(f"w{i}" for i in range(500))
    session = Session(tab="tab-1")
    gen = ctl.send("local", None, "long story", [], "", GenerationSettings.preset(False), session)
    view = None
    for view in gen:
        if view.conv_id and "w5" in str(view.messages):
            break
    gen.close()
    assert ctl.close_tab("other-tab") == 0 and ctl.close_tab("tab-1") == 1
    assert ctl.live.wait_idle(30)
    call = ctl.backend.calls[-1]
    assert call.finish_reason in ("cancelled", "closed") and call.steps < 100
    reply = ctl.store.user("local").load(view.conv_id).messages[-1]
    assert reply.status == "stopped" and reply.text.startswith("w0 w1 w2 w3 w4 w5")
    assert session.cancel is None and ctl.backend.active == 0


def test_stop_token_ends_the_stream_with_stopped_status(ctl):
    ctl.backend.step_delay_s = 0.01
    ctl.backend.answer = " ".join(f"w{i}" for i in range(500))
    session = Session()
    views = []
    for view in ctl.send("local", None, "long story", [], "", GenerationSettings.preset(False), session):
        views.append(view)
        if "w3" in str(view.messages):
            ctl.stop(session)
    assert views[-1].done
    reply = ctl.store.user("local").load(views[-1].conv_id).messages[-1]
    assert reply.status == "stopped"
    assert views[-1].messages[-2]["content"][0]["text"].endswith("*[stopped by the user]*")
    assert views[-1].messages[-1]["metadata"] == {"status": "done"}  # the statistics line under it


def test_stream_ended_by_a_shutdown_is_saved_as_interrupted_not_stopped(ctl):
    """The engine drains open streams with finish "cancelled" when the service shuts down (SIGTERM, Supervisor
    restart).  Nobody pressed Stop, so the reply is saved as interrupted, not as stopped by the user."""
    class ShutDown(FakeBackend):
        def _stream(self, call, cancel):
            for i, update in enumerate(super()._stream(call, cancel)):
                if i == 3:
                    yield StreamUpdate(answer=update.answer, finish_reason="cancelled")
                    return
                yield update

    ctl.backend = ShutDown.for_ui(answer=" ".join(f"w{i}" for i in range(50)))
    views = list(ctl.send("local", None, "long story", [], "", GenerationSettings.preset(False), Session()))
    reply = ctl.store.user("local").load(views[-1].conv_id).messages[-1]
    assert reply.status == "interrupted" and reply.text == "w0 w1 w2 w3"


def test_engine_fault_mid_stream_is_saved_as_error_and_shown(ctl):
    class Faulty(FakeBackend):
        def _stream(self, call, cancel):
            yield from list(super()._stream(call, cancel))[:2]
            raise RuntimeError("device-side assert")

    ctl.backend = Faulty.for_ui(answer="partial answer here")
    views = run_turn(ctl, "hi")
    reply = ctl.store.user("local").load(views[-1].conv_id).messages[-1]
    assert reply.status == "error"
    assert "device-side assert" in reply.notice and "device-side assert" in views[-1].notice
    assert views[-1].messages[-2]["content"][0]["text"].startswith("*[generation failed")
    assert run_turn(ctl, "again", conv_id=views[-1].conv_id)[-1].done  # next turn works


def test_interrupted_reply_after_restart_is_shown_as_interrupted(tmp_path):
    """A reply left ``streaming`` by a process that died (kill -9) reopens marked as interrupted."""
    store = HistoryStore(tmp_path)
    history = store.user("local")
    conv = history.create()
    history.append_message(conv.id, role="user", text="tell me")
    reply = history.append_message(conv.id, role="assistant", text="Once upon", status="streaming")
    # simulate the dead writer: the file says "streaming" but this process did not write it
    import json

    path = next((tmp_path / "users" / "local" / "conversations").glob("*.json"))
    data = json.loads(path.read_text())
    assert data["messages"][reply]["status"] == "streaming"
    data["messages"][reply]["writer"] = "12345-a-process-that-is-gone"
    path.write_text(json.dumps(data))
    restarted = ChatController(FakeBackend.for_ui(), HistoryStore(tmp_path))
    chat = restarted.open("local", conv.id)[0]
    assert chat[-1]["content"][0]["text"] == "Once upon\n\n*[interrupted: the service stopped before this reply finished]*"


def test_unfinished_reasoning_and_live_reply_rendering():
    from qwen_chat.history.records import StoredMessage

    msgs = [StoredMessage.new("user", "q"),
            StoredMessage.new("assistant", "", reasoning="thinking <b>hard</b>", status="length")]
    chat = chatbot_messages(msgs, image_path=None)
    assert chat[1]["metadata"]["title"] == "Thinking (unfinished)"
    assert chat[1]["content"][0]["text"] == "thinking &lt;b>hard&lt;/b>"
    assert chat[2]["content"][0]["text"] == "*[token limit reached]*"
    live = chatbot_messages(msgs[:1] + [StoredMessage.new("assistant", "", reasoning="so far", status="streaming")],
                            image_path=None, live_index=1)
    assert live[1]["metadata"] == {"title": "Thinking", "status": "pending"}
    assert len(live) == 2  # no answer bubble yet, no "interrupted" label while it is live


def test_too_many_images_refused_before_saving(ctl, tmp_path):
    ctl.max_images_per_turn = 2
    with pytest.raises(InvalidImage, match="at most 2 images"):
        run_turn(ctl, "three cats", files=[CHELSEA] * 3)
    assert ctl.store.user("local").list() == [] and ctl.backend.calls == []


def test_system_prompt_and_history_reach_the_backend_without_old_reasoning(ctl):
    views = run_turn(ctl, "first")
    conv_id = views[-1].conv_id
    list(ctl.send("local", conv_id, "second", [], "Answer in French.", GenerationSettings.preset(True), Session()))
    sent = ctl.backend.calls[-1].messages
    assert [(m.role, m.text) for m in sent] == [
        ("system", "Answer in French."), ("user", "first"), ("assistant", "You said: first (0 image(s))"),
        ("user", "second")]
    assert ctl.store.user("local").load(conv_id).settings["system_prompt"] == "Answer in French."


def test_concurrent_sessions_do_not_mix(ctl):
    ctl.backend.step_delay_s = 0.005
    results = {}

    def user(name):
        results[name] = run_turn(ctl, f"I am {name}")[-1]

    threads = [threading.Thread(target=user, args=(n,)) for n in ("ann", "ben", "cid")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for name, view in results.items():
        answer = view.messages[-2]["content"][0]["text"]
        assert answer == f"You said: I am {name} (0 image(s))"
    assert len({v.conv_id for v in results.values()}) == 3


def test_stop_before_the_turn_has_its_token_stops_it_when_it_does(ctl):
    """Stop right after Send, before the turn registered its cancel token: the turn ends stopped at once."""
    ctl.backend.step_delay_s = 0.01
    ctl.backend.answer = " ".join(f"w{i}" for i in range(300))
    session = Session()
    ctl.stop(session)  # the turn has not started yet
    views = list(ctl.send("local", None, "long", [], "", GenerationSettings.preset(False), session))
    reply = ctl.store.user("local").load(views[-1].conv_id).messages[-1]
    assert reply.status == "stopped" and len(reply.text.split()) < 300
    assert not session.stop_asked  # used up: the next turn runs
    views = list(ctl.send("local", views[-1].conv_id, "again", [], "", GenerationSettings.preset(False), session))
    assert ctl.store.user("local").load(views[-1].conv_id).messages[-1].status == "complete"


def test_second_send_while_streaming_is_refused_until_stopped(ctl):
    ctl.backend.step_delay_s = 0.01
    ctl.backend.answer = " ".join(f"w{i}" for i in range(300))
    session = Session()
    running = ctl.send("local", None, "long", [], "", GenerationSettings.preset(False), session)
    first = next(running)
    next(running)
    with pytest.raises(InvalidInput, match="still being written"):
        run_turn(ctl, "another", session=session)
    ctl.stop(session)
    views = run_turn(ctl, "another", session=session)  # allowed once Stop was pressed
    assert ctl.store.user("local").load(views[-1].conv_id).messages[-1].status == "complete"
    running.close()
    assert session.cancel is None
    assert first.conv_id == ""  # a new conversation gets its id once the backend accepted the turn


def test_stored_index_maps_shown_positions_past_thoughts_and_system_messages():
    from qwen_chat.history.records import StoredMessage

    msgs = [StoredMessage.new("system", "be brief"), StoredMessage.new("user", "q1"),
            StoredMessage.new("assistant", "a1", reasoning="hmm"), StoredMessage.new("user", "q2"),
            StoredMessage.new("assistant", "", status="stopped")]
    shown = chatbot_messages(msgs, image_path=None)
    assert [m["role"] for m in shown] == ["user", "assistant", "assistant", "user", "assistant"]
    assert [stored_index(msgs, i) for i in range(len(shown))] == [1, 2, 2, 3, 4]
    assert stored_index(msgs, 5) is None and stored_index(msgs, -1) is None


def test_edit_resends_the_message_and_keeps_the_earlier_version(ctl):
    first = run_turn(ctl, "what is in this photo?", files=[CHELSEA])[-1]
    conv_id = first.conv_id
    run_turn(ctl, "and the second question", conv_id=conv_id)
    history = ctl.store.user("local")
    image = history.load(conv_id).messages[0].images
    views = list(ctl.edit("local", conv_id, 0, "  what colour is the cat? ", "", GenerationSettings.preset(False),
                          Session()))
    saved = history.load(conv_id)
    assert [(m.role, m.text) for m in saved.messages] == [
        ("user", "what colour is the cat?"), ("assistant", "You said: what colour is the cat? (1 image(s))")]
    assert saved.messages[0].images == image  # the image stays with the edited message
    assert saved.title == "what colour is the cat?"
    assert "the earlier version is kept" in views[-1].notice
    kept = [h.message.text for h in saved.branches]  # the first version and the turns after it are kept
    assert kept == ["what is in this photo?", "You said: what is in this photo? (1 image(s))",
                    "and the second question", "You said: and the second question (0 image(s))"]
    sent = ctl.backend.calls[-1].messages
    assert [m.text for m in sent] == ["what colour is the cat?"] and len(sent[0].images) == 1


def test_edit_refusals_change_nothing(ctl):
    conv_id = run_turn(ctl, "question")[-1].conv_id
    history = ctl.store.user("local")
    before = history.load(conv_id).to_dict()
    settings = GenerationSettings.preset(False)
    for index, text, error in [(1, "x", "only your own"), (7, "x", "only your own"), (0, " \u200b ", "empty")]:
        with pytest.raises(InvalidInput, match=error):
            list(ctl.edit("local", conv_id, index, text, "", settings, Session()))
    with pytest.raises(InvalidInput, match="open a conversation"):
        list(ctl.edit("local", "", 0, "x", "", settings, Session()))
    from qwen_chat.chat_types import NotReady

    ctl.backend.ready = False
    with pytest.raises(NotReady):
        list(ctl.edit("local", conv_id, 0, "edited", "", settings, Session()))
    assert history.load(conv_id).to_dict() == before  # refused before the backend accepted: disk untouched


def test_conversation_choices_apply_the_search(ctl):
    a = run_turn(ctl, "about cats")[-1].conv_id
    b = run_turn(ctl, "about dogs")[-1].conv_id
    assert [cid for _, cid in ctl.conversation_choices("local")] == [b, a]
    assert [cid for _, cid in ctl.conversation_choices("local", "CATS")] == [a]
    assert ctl.conversation_choices("local", "zebra") == []


def test_conversation_with_a_missing_image_still_opens(ctl):
    views = run_turn(ctl, "look", files=[CHELSEA])
    conv_id = views[-1].conv_id
    history = ctl.store.user("local")
    name = history.load(conv_id).messages[0].images[0]
    history.image_path(name).unlink()
    chat = ctl.open("local", conv_id)[0]
    assert chat[0]["content"][0]["text"] == "*[image no longer available]*"
    assert chat[0]["content"][1]["text"] == "look"
