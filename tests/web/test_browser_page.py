"""Real-browser tests of the chat page as a new user meets it (headless chromium, real server, scripted backend).

1. A refused message (too long for the context, model still loading) stays in the message box.
2. A new conversation is listed as soon as its first message is sent, also when its first reply is stopped;
   Enter is visibly disabled while a reply streams.
3. The conversation list scrolls inside its own area with Rename / Delete / Export always visible, entries
   carry their date, the search box filters, the Title box follows the open conversation, Delete asks first,
   the export card goes away when another conversation is opened.
4. The chat's trash icon starts a new chat: the next message does not continue the old conversation.
5. Editing a sent message resends it and replaces the turns after it.
6. After a crash and restart the tab reattaches to the interrupted conversation; the next message joins it.
7. The demo model's defaults, the footer (no Gradio API page, a note on the OpenAI-compatible API) and a
   phone-sized window (the sidebar starts closed).
"""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import Error as PlaywrightError

from qwen_chat.chat_types import ContextTooLong
from qwen_chat.config import ServiceConfig
from qwen_chat.history.store import HistoryStore
from qwen_chat.web.server import build_app
from tests.support.fake_backend import FakeBackend
from tests.support.servers import RunningServer
from tests.support.waiting import wait_until
from tests.support.browsing import (  # noqa: F401 (fixtures)
    bot_text,
    browser,
    field,
    notice_text,
    open_app,
    page,
    send,
    sidebar_labels,
    user_texts,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

LONG_ANSWER = " ".join(f"word{i}" for i in range(300))
STATUS_LABEL = re.compile(r"\[(interrupted: the service stopped before this reply finished|stopped by the user)\]")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    backend = FakeBackend.for_ui()
    store = HistoryStore(root)
    with RunningServer(build_app(ServiceConfig(history_dir=root), backend, store)) as running:
        yield running, backend, store


@pytest.fixture
def ui(service, page):
    """(page, backend, store): the page opened on the shared server, the backend reset to its defaults."""
    running, backend, store = service
    defaults = FakeBackend.for_ui()
    for name in ("answer", "step_delay_s", "fail_with", "ready", "max_steps"):
        setattr(backend, name, getattr(defaults, name))
    open_app(page, running.url)
    return page, backend, store


def history_texts(store, title: str) -> list[str]:
    history = store.user("local")
    [conv] = [s for s in history.list() if s.title == title]
    return [m.text for m in history.load(conv.id).messages]


def test_refused_message_stays_in_the_box(ui):
    page, backend, store = ui
    typed = "Please summarise: " + "lorem ipsum " * 25_000  # 300,018 characters
    backend.fail_with = ContextTooLong("prompt is 50002 tokens; the context holds 4096", 50002, 4096)
    box = page.locator("#msg textarea")
    box.fill(typed)
    box.press("Enter")
    wait_until(lambda: "the context holds 4096" in notice_text(page), what="the refusal notice")
    wait_until(lambda: box.is_enabled())
    assert box.input_value() == typed  # nothing typed is lost
    assert user_texts(page) == [] and "Please summarise" not in " ".join(sidebar_labels(page))

    backend.fail_with, backend.ready = None, False  # the model is still loading
    box.fill("hello while loading")
    box.press("Enter")
    wait_until(lambda: "still loading" in notice_text(page), what="the loading notice")
    wait_until(lambda: box.input_value() == "hello while loading")

    backend.ready = True
    box.press("Enter")
    wait_until(lambda: "You said: hello while loading" in bot_text(page))
    assert box.input_value() == ""


def test_new_conversation_is_listed_at_once_and_after_an_early_stop(ui):
    page, backend, store = ui
    backend.answer, backend.step_delay_s = LONG_ANSWER, 0.1
    send(page, "A question listed at once")
    wait_until(lambda: "word2" in bot_text(page))
    assert any(label.startswith("A question listed at once") for label in sidebar_labels(page))
    assert field(page, "title-box").input_value() == "A question listed at once"
    box = page.locator("#msg textarea")  # Enter is visibly disabled while the reply streams
    assert box.is_disabled() and box.get_attribute("placeholder") == "Wait for the reply or press Stop"
    assert not page.locator("#send").is_enabled() and not page.locator("#regenerate").is_enabled()
    page.locator("#stop").click()
    wait_until(lambda: "[stopped by the user]" in bot_text(page))

    page.locator("#new-chat").click()
    wait_until(lambda: bot_text(page) == "" and box.is_enabled())
    send(page, "Stopped right away")
    wait_until(lambda: "word0" in bot_text(page))
    page.locator("#stop").click()
    wait_until(lambda: "[stopped by the user]" in bot_text(page))
    wait_until(lambda: any(label.startswith("Stopped right away") for label in sidebar_labels(page)),
               what="the stopped conversation in the sidebar")
    assert page.locator("#conv-list input:checked").count() == 1  # and it is the one selected
    assert history_texts(store, "Stopped right away")[0] == "Stopped right away"


def test_sidebar_scrolls_dates_search_title_delete_and_export(ui):
    page, backend, store = ui
    history = store.user("local")
    for i in range(30):
        conv = history.create()
        history.append_message(conv.id, role="user", text="Same title" if i % 2 else f"Topic number {i}")
    page.reload()
    wait_until(lambda: len(sidebar_labels(page)) >= 30)
    listed = page.locator("#conv-list")
    assert listed.evaluate("e => e.scrollHeight > e.clientHeight")  # the list scrolls in its own area
    for button in ("#rename", "#delete", "#export"):
        box = page.locator(button).bounding_box()
        assert box and box["y"] + box["height"] <= 900, button  # still on screen
    same = [label for label in sidebar_labels(page) if label.startswith("Same title")]
    assert len(same) == 15 and all(re.fullmatch(r"Same title · today \d\d:\d\d", s) for s in same)

    field(page, "search").fill("topic number 2")
    wait_until(lambda: sorted(sidebar_labels(page)) == sorted(
        label for label in sidebar_labels(page) if label.startswith("Topic number 2")) and sidebar_labels(page))
    assert {label.split(" · ")[0] for label in sidebar_labels(page)} == {"Topic number 2", "Topic number 20",
                                                                        "Topic number 22", "Topic number 24",
                                                                        "Topic number 26", "Topic number 28"}
    field(page, "search").fill("")
    wait_until(lambda: len(sidebar_labels(page)) >= 30)

    page.locator("#conv-list label", has_text="Topic number 28").click()
    wait_until(lambda: field(page, "title-box").input_value() == "Topic number 28")
    page.locator("#export").click()
    export_card = page.locator("#export-file")
    wait_until(lambda: export_card.is_visible())
    page.locator("#conv-list label", has_text="Topic number 26").click()
    wait_until(lambda: field(page, "title-box").input_value() == "Topic number 26")
    wait_until(lambda: not export_card.is_visible(), what="the export card to go away")

    question = page.locator("#delete-question").first
    page.locator("#delete").click()
    wait_until(lambda: question.is_visible())
    assert "Delete \u201cTopic number 26\u201d" in question.inner_text()
    page.locator("#delete-no").click()
    wait_until(lambda: not question.is_visible())
    assert any(s.title == "Topic number 26" for s in history.list())  # Cancel kept it
    page.locator("#delete").click()
    page.locator("#delete-yes").click()
    wait_until(lambda: notice_text(page) == "Conversation deleted.")
    assert not any(s.title == "Topic number 26" for s in history.list())
    assert not any(label.startswith("Topic number 26") for label in sidebar_labels(page))
    wait_until(lambda: not question.is_visible())
    assert user_texts(page) == []


def test_trash_icon_starts_a_new_chat(ui):
    page, backend, store = ui
    send(page, "Before the trash icon")
    wait_until(lambda: "You said: Before the trash icon" in bot_text(page))
    page.locator("#chatbot button[aria-label=Clear]").click()
    wait_until(lambda: "New chat started" in notice_text(page))
    assert user_texts(page) == []
    send(page, "After the trash icon")
    wait_until(lambda: "You said: After the trash icon" in bot_text(page))
    assert user_texts(page) == ["After the trash icon"]  # the old turns do not come back
    assert history_texts(store, "Before the trash icon") == ["Before the trash icon",
                                                             "You said: Before the trash icon (0 image(s))"]
    assert history_texts(store, "After the trash icon") == ["After the trash icon",
                                                            "You said: After the trash icon (0 image(s))"]


def test_edited_message_is_resent_and_replaces_the_later_turns(ui):
    page, backend, store = ui
    send(page, "What is 2+2? <b>quick</b>")
    wait_until(lambda: "You said: What is 2+2?" in bot_text(page))
    send(page, "And 3+3?")
    wait_until(lambda: "You said: And 3+3?" in bot_text(page))
    page.locator("#chatbot [data-testid=user]").first.hover()
    page.locator("#chatbot button[aria-label=Edit]").first.click()
    editor = page.locator("#chatbot textarea.edit-textarea")
    editor.fill("What is 5+5? <b>quick</b>")
    page.locator("#chatbot button[aria-label=Submit]").click()
    wait_until(lambda: "You said: What is 5+5? <b>quick</b>" in bot_text(page))
    assert user_texts(page) == ["What is 5+5? <b>quick</b>"]  # the later turn is gone
    assert "And 3+3" not in bot_text(page)
    assert "the turns after it were replaced" in notice_text(page)
    assert history_texts(store, "What is 5+5? <b>quick</b>") == [
        "What is 5+5? <b>quick</b>", "You said: What is 5+5? <b>quick</b> (0 image(s))"]


def test_tab_reattaches_to_the_interrupted_conversation_after_a_crash(browser, tmp_path):
    root = tmp_path / "history"
    cfg = ServiceConfig(history_dir=root)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        first = RunningServer(build_app(cfg, FakeBackend.for_ui(answer=LONG_ANSWER, step_delay_s=0.1),
                                        HistoryStore(root)))
        with first:
            open_app(page, first.url)
            send(page, "Tell me a long story")
            wait_until(lambda: "word5" in bot_text(page))
        # the service is gone mid-reply: Gradio reports the lost connection and polls until it is back
        wait_until(lambda: page.get_by_text("Connection to the server was lost").count() > 0)
        loads = []
        page.on("load", lambda _: loads.append(1))
        with RunningServer(build_app(cfg, FakeBackend.for_ui(answer="I am back"), HistoryStore(root)),
                           port=first.port):
            # Gradio reloads the page once the server answers again; the tab reopens its conversation.  (The
            # in-process server's shutdown closes the stream, so the reply reads "stopped", or "interrupted"
            # when the old server had no time left to save it; after kill -9 it always reads "interrupted".)
            def reloaded():
                try:  # bot_text first: playwright hands over the page's events only during its own calls
                    return STATUS_LABEL.search(bot_text(page)) and loads
                except PlaywrightError:  # the page is being reloaded right now
                    return False

            wait_until(reloaded, timeout_s=90, what="the reloaded page showing the conversation")
            assert user_texts(page) == ["Tell me a long story"] and "word5" in bot_text(page)
            send(page, "Please go on")
            wait_until(lambda: "I am back" in bot_text(page))
        history = HistoryStore(root).user("local")
        [summary] = history.list()
        texts = [m.text for m in history.load(summary.id).messages]
        assert texts[0] == "Tell me a long story" and texts[1].startswith("word0 word1")
        assert texts[2:] == ["Please go on", "I am back"]
    finally:
        context.close()


def test_demo_defaults_footer_and_phone_sized_window(service, page, browser):
    running, backend, store = service
    open_app(page, running.url)
    page.locator("#settings").get_by_text("Settings").first.click()
    assert not page.locator("#thinking input[type=checkbox]").is_checked()
    assert page.locator("#max-new-tokens input[type=number]").input_value() == "256"
    assert "Use via API" not in page.locator("footer").inner_text()
    assert "/v1/chat/completions" in page.locator("#api-note").inner_text()

    phone = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        small = phone.new_page()
        open_app(small, running.url)
        wait_until(lambda: "open" not in (small.locator("#sidebar").get_attribute("class") or "").split(),
                   what="the sidebar to close on a narrow screen")
        assert small.locator("#msg textarea").is_visible()
        small.locator("#sidebar .toggle-button").click()  # the user opens it, picks a conversation: it closes
        small.locator("#conv-list label").first.click()
        wait_until(lambda: "open" not in (small.locator("#sidebar").get_attribute("class") or "").split())
        wait_until(lambda: user_texts(small) != [])
    finally:
        phone.close()
