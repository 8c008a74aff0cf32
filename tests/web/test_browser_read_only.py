"""Real-browser test (headless Debian chromium, real server, scripted backend) of the chat page when the history
folder stops being writable mid-reply: a short notice without server paths, the reply shown whole, Send / Stop
back to normal, a message sent meanwhile handed back to the box, and the next message answered once the folder
is writable again.  The folder is made unwritable in Python (``tests.support.read_only``): the tests run as
root, for whom ``chmod`` blocks nothing."""
from __future__ import annotations

import pytest

from qwen_chat.config import ServiceConfig
from qwen_chat.history.store import HistoryStore
from qwen_chat.history.turns import SAVE_RETRY_S
from qwen_chat.web.server import build_app
from tests.support import browsing
from tests.support.browsing import bot_text, notice_text, open_app, send
from tests.support.fake_backend import FakeBackend
from tests.support.read_only import ReadOnlyFolder
from tests.support.servers import RunningServer
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

browser, page = browsing.browser, browsing.page  # the module's fixtures: one chromium, a fresh tab per test
ANSWER = " ".join(f"word{i}" for i in range(150))
NOT_WRITABLE = "Could not save the conversation: the history folder is not writable"


def idle(pg) -> bool:
    return pg.locator("#send").is_enabled() and not pg.locator("#stop").is_enabled()


def test_read_only_history_mid_reply_shows_a_notice_and_the_tab_stays_usable(page, tmp_path, monkeypatch):
    backend = FakeBackend.for_ui(answer=ANSWER, step_delay_s=0.03)
    store = HistoryStore(tmp_path)
    history = store.user("local")
    folder = ReadOnlyFolder(tmp_path, monkeypatch)
    with RunningServer(build_app(ServiceConfig(history_dir=tmp_path), backend, store)) as running:
        open_app(page, running.url)
        send(page, "tell me a story")
        # the reply's own save (the user's message alone, saved a moment before the reply is created, is not
        # enough: a folder turned read-only in between refuses the whole turn, which is another case)
        wait_until(lambda: any(history.load(s.id).messages[-1].role == "assistant"
                               and history.load(s.id).messages[-1].text for s in history.list()), timeout_s=60,
                   what="a save of the reply with some text")
        folder.on = True
        try:
            wait_until(lambda: idle(page) and "word149" in bot_text(page), timeout_s=60, what="the reply's end")
        except TimeoutError as e:  # say which half was missing
            raise TimeoutError(f"{e}; idle: {idle(page)}; chat ends with {bot_text(page)[-60:]!r}; "
                               f"notice {notice_text(page)!r}") from None
        notice = wait_until(lambda: NOT_WRITABLE in notice_text(page) and notice_text(page), timeout_s=30,
                            what="the notice")
        assert str(tmp_path) not in notice and "Errno" not in notice and ".lock" not in notice
        assert "still being written" not in notice
        # a message while still read-only: refused with the same notice, its text back in the box
        started = len(backend.calls)
        send(page, "are you still there?")
        wait_until(lambda: len(backend.calls) > started and idle(page)
                   and page.locator("#msg textarea").input_value() == "are you still there?",
                   timeout_s=30, what="the refused message back in the box")
        assert NOT_WRITABLE in notice_text(page)
        # writable again: the reply is saved whole and the next message is answered
        folder.on = False
        [conv] = history.list()
        wait_until(lambda: history.load(conv.id).messages[-1].status == "complete", timeout_s=10 * SAVE_RETRY_S,
                   what="the reply saved once the folder is writable")
        backend.answer, backend.step_delay_s = "fine thanks", 0.0
        page.locator("#msg textarea").press("Enter")
        wait_until(lambda: idle(page) and "fine thanks" in bot_text(page), timeout_s=60, what="the next reply")
        assert notice_text(page) == ""
        assert [m.text for m in history.load(conv.id).messages] == [
            "tell me a story", ANSWER, "are you still there?", "fine thanks"]
