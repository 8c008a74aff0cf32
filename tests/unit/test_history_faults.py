"""A history folder that stops being writable (permissions, read-only mount, full disk), as the chat page's
controller and the store meet it: a short message without server paths, what was saved kept, the reply and
the tab going on, and the reply saved once the folder is writable again."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from qwen_chat.chat_types import GenerationSettings
from qwen_chat.history.errors import HistoryUnavailable, unavailable
from qwen_chat.history.presets import Preset, Presets
from qwen_chat.history.store import HistoryStore
from qwen_chat.history.turns import SAVE_RETRY_S
from qwen_chat.web.handlers import ChatController, Session
from tests.support.fake_backend import FakeBackend
from tests.support.read_only import ReadOnlyFolder
from tests.support.waiting import wait_until

NOT_WRITABLE = "Could not save the conversation: the history folder is not writable"
ANSWER = " ".join(f"w{i}" for i in range(80))
SETTINGS = GenerationSettings.preset(False)


def no_server_path(text: str, root: Path) -> bool:
    """True when ``text`` names no file of the server (no folder, no errno text of an ``OSError``)."""
    return str(root) not in text and "/" not in text and "Errno" not in text and ".lock" not in text


@pytest.fixture
def ctl(tmp_path):
    backend = FakeBackend.for_ui(answer=ANSWER, step_delay_s=0.01)
    return ChatController(backend, HistoryStore(tmp_path), save_interval_s=0.02, ui_interval_s=0.0)


def test_reply_goes_on_when_the_folder_turns_read_only_and_is_saved_once_writable(ctl, tmp_path, monkeypatch):
    folder = ReadOnlyFolder(tmp_path, monkeypatch)
    history = ctl.store.user("local")
    session = Session()
    views = []
    for view in ctl.send("local", None, "tell me a story", [], "", SETTINGS, session):
        views.append(view)
        if not folder.on and view.conv_id and history.load(view.conv_id).messages[-1].text:
            folder.on = True  # mid-reply, after a save with some text
    assert folder.refused
    conv_id, last = views[-1].conv_id, views[-1]
    # the page: a short message, no path; the reply shown whole and the turn over
    noted = [v.notice for v in views if NOT_WRITABLE in v.notice]
    assert noted and last.done and NOT_WRITABLE in last.notice
    assert all(no_server_path(n, tmp_path) for n in noted)
    assert ANSWER in [p["text"] for m in last.messages if m["role"] == "assistant" for p in m["content"]]
    # the disk keeps what was saved before the folder turned read-only
    kept = history.load(conv_id).messages
    assert [m.role for m in kept] == ["user", "assistant"] and kept[1].status == "streaming"
    assert kept[1].text and ANSWER.startswith(kept[1].text) and kept[1].text != ANSWER
    # the tab is free: no reply counted as running; a message now is refused with the same clear message
    assert session.cancel is None and not ctl.live.running("local")
    with pytest.raises(HistoryUnavailable, match=NOT_WRITABLE) as refused:
        list(ctl.send("local", conv_id, "still there?", [], "", SETTINGS, session))
    assert no_server_path(str(refused.value), tmp_path)
    assert len(history.load(conv_id).messages) == 2
    # writable again: the reply is saved whole with its real status, and the next turn works
    folder.on = False
    wait_until(lambda: history.load(conv_id).messages[1].status == "complete", timeout_s=10 * SAVE_RETRY_S,
               what="the reply saved after the folder came back")
    assert history.load(conv_id).messages[1].text == ANSWER
    ctl.backend.answer = "fine"
    again = list(ctl.send("local", conv_id, "still there?", [], "", SETTINGS, session))
    assert again[-1].done and again[-1].notice == ""
    assert [(m.role, m.status) for m in history.load(conv_id).messages] == [
        ("user", "complete"), ("assistant", "complete"), ("user", "complete"), ("assistant", "complete")]


def test_first_message_refused_cleanly_while_read_only(ctl, tmp_path, monkeypatch):
    history = ctl.store.user("local")
    folder = ReadOnlyFolder(tmp_path, monkeypatch)
    folder.on = True
    session = Session()
    with pytest.raises(HistoryUnavailable, match=NOT_WRITABLE):
        list(ctl.send("local", None, "hello", [], "", SETTINGS, session))
    assert session.cancel is None and history.list() == [] and not ctl.live.running("local")
    folder.on = False
    views = list(ctl.send("local", None, "hello", [], "", SETTINGS, session))
    assert views[-1].done and [m.text for m in history.load(views[-1].conv_id).messages][-1] == ANSWER


def test_store_operations_name_the_problem_without_paths(tmp_path, monkeypatch):
    history = HistoryStore(tmp_path).user("local")
    conv = history.create()
    folder = ReadOnlyFolder(tmp_path, monkeypatch)
    folder.on = True
    for attempt, action in [(lambda: history.create(), "save the conversation"),
                            (lambda: history.rename(conv.id, "new title"), "save the conversation"),
                            (lambda: history.delete(conv.id), "delete the conversation"),
                            (lambda: Presets(history).save(Preset.make("mine", "", SETTINGS)), "save the presets")]:
        with pytest.raises(HistoryUnavailable) as refused:
            attempt()
        message = str(refused.value)
        assert message == f"Could not {action}: the history folder is not writable"
        assert no_server_path(message, tmp_path)
    folder.on = False
    assert history.load(conv.id).title == conv.title  # nothing changed


@pytest.mark.parametrize("code,writing,reason", [
    (errno.ENOSPC, True, "the disk holding the history folder is full"),
    (errno.EROFS, True, "the history folder is on a read-only file system"),
    (errno.EACCES, False, "the history folder is not readable"),
    (errno.EIO, True, "input/output error"),
])
def test_disk_errors_read_as_what_they_mean(code, writing, reason):
    exc = OSError(code, "strerror text" if code != errno.EIO else "Input/output error", "/srv/history/x.json")
    assert str(unavailable("save the conversation", exc, writing)) == f"Could not save the conversation: {reason}"
