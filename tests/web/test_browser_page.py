"""Real-browser tests of the chat page as a new user meets it (headless chromium, real server, scripted backend).

1. A refused message (too long for the context, model still loading) stays in the message box.
2. A new conversation is listed as soon as its first message is sent, also when its first reply is stopped;
   Enter is visibly disabled while a reply streams.
3. The conversation list scrolls inside its own area with Download always visible (the old Title box and
   Rename / Delete buttons are gone: the entry menu has them), entries carry their date, the search box
   filters, Download downloads the open conversation in one click, named after it, the menu's Export
   downloads its entry the same way, the menu's Delete asks first.
4. The chat's trash icon starts a new chat: the next message does not continue the old conversation.
5. Editing a sent message resends it; the earlier version and the turns after it are kept (``< 1/2 >``).
6. After a crash and restart the tab reattaches to the interrupted conversation; the next message joins it.
7. The demo model's defaults, the footer (no Gradio API page, a note on the OpenAI-compatible API) and a
   phone-sized window (the sidebar starts closed).
"""
from __future__ import annotations

import re
import time

import pytest
from playwright.sync_api import Error as PlaywrightError

from qwen_chat.chat_types import ContextTooLong
from qwen_chat.config import ServiceConfig
from qwen_chat.history.store import HistoryStore
from qwen_chat.web.page_js import DRAFT_SAVE_MS
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
    open_fresh,
    page,
    send,
    shared_ui_server,
    sidebar_labels,
    user_texts,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

LONG_ANSWER = " ".join(f"word{i}" for i in range(300))
STATUS_LABEL = re.compile(r"\[(interrupted: the service stopped before this reply finished|stopped by the user)\]")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    yield from shared_ui_server(tmp_path_factory)


@pytest.fixture
def ui(service, page):
    """(page, backend, store): the page opened on the shared server, the backend reset to its defaults."""
    running, backend, store = service
    open_fresh(page, running, backend)
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


def test_a_message_typed_but_not_sent_survives_a_reload_and_a_sent_one_does_not_come_back(ui):
    """Gradio reloads a tab after the service restarted: what the user was typing is put back in the box."""
    page, backend, store = ui
    box = page.locator("#msg textarea")
    box.fill("half-written question")
    time.sleep(DRAFT_SAVE_MS / 1000 * 2.5)
    page.reload()
    box = page.locator("#msg textarea")
    wait_until(lambda: box.input_value() == "half-written question", what="the draft back in the box")
    box.press("Enter")
    wait_until(lambda: "You said: half-written question" in bot_text(page) and box.is_enabled())
    assert box.input_value() == ""
    time.sleep(DRAFT_SAVE_MS / 1000 * 2.5)
    page.reload()
    page.locator("#msg textarea").wait_for()
    time.sleep(DRAFT_SAVE_MS / 1000 * 2.5)
    assert page.locator("#msg textarea").input_value() == ""  # sent: not typed again


def test_new_conversation_is_listed_at_once_and_after_an_early_stop(ui):
    page, backend, store = ui
    backend.answer, backend.step_delay_s = LONG_ANSWER, 0.1
    send(page, "A question listed at once")
    wait_until(lambda: "word2" in bot_text(page))
    assert any(label.startswith("A question listed at once") for label in sidebar_labels(page))
    chosen = page.locator("#conv-list label", has=page.locator("input:checked"))  # and it is the open one
    assert chosen.inner_text().startswith("A question listed at once")
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


def test_a_follow_up_moves_its_conversation_to_the_top_while_the_reply_streams(ui):
    page, backend, store = ui
    history = store.user("local")
    for title in ("Older chat", "Newer chat"):
        conv = history.create()
        history.append_message(conv.id, role="user", text=title)
        time.sleep(0.01)
    page.reload()
    wait_until(lambda: [label.split(" · ")[0] for label in sidebar_labels(page)][:2] == ["Newer chat", "Older chat"])
    page.locator("#conv-list label", has_text="Older chat").click()
    wait_until(lambda: user_texts(page) == ["Older chat"])
    backend.answer, backend.step_delay_s = LONG_ANSWER, 0.05
    send(page, "a follow-up")
    wait_until(lambda: sidebar_labels(page)[0].startswith("Older chat") and "writing" in sidebar_labels(page)[0],
               what="the followed-up conversation first in the list, marked as writing")
    assert page.locator("#stop").is_enabled()  # while its reply still streams
    page.locator("#stop").click()
    wait_until(lambda: "[stopped by the user]" in bot_text(page))


def test_sidebar_scrolls_dates_search_menu_delete_and_download(ui):
    page, backend, store = ui
    history = store.user("local")
    for i in range(30):
        conv = history.create()
        history.append_message(conv.id, role="user", text="Same title" if i % 2 else f"Topic number {i}")
    page.reload()
    wait_until(lambda: len(sidebar_labels(page)) >= 30)
    listed = page.locator("#conv-list")
    assert listed.evaluate("e => e.scrollHeight > e.clientHeight")  # the list scrolls in its own area
    box = page.locator("#export").bounding_box()
    assert box and box["y"] + box["height"] <= 900  # Download still on screen
    for hidden in ("#title-box", "#rename", "#delete"):  # the entry menu renames and deletes
        assert not page.locator(hidden).is_visible(), hidden
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

    def downloaded(click) -> str:
        with page.expect_download() as download:
            click()
        return download.value.suggested_filename

    page.locator("#conv-list label", has_text="Topic number 28").click()
    wait_until(lambda: user_texts(page) == ["Topic number 28"] and page.locator("#export").is_enabled())
    # one click downloads the open conversation, named after it
    wait_until(lambda: downloaded(page.locator("#export").click) == "Topic number 28.zip",
               what="the Download button holding the open conversation")
    page.locator("#conv-list label", has_text="Topic number 26").click()
    wait_until(lambda: user_texts(page) == ["Topic number 26"])
    wait_until(lambda: downloaded(page.locator("#export").click) == "Topic number 26.zip",
               what="the button following the open conversation")
    # the open conversation stands out in the list (bold, a bar on its left); the others do not
    # (read once the list's style transition has settled: mid-way the weight reads e.g. "400.75")
    page.wait_for_timeout(500)
    looks = page.evaluate("() => [...document.querySelectorAll('#conv-list label')].map(l => [l.innerText, "
                          "getComputedStyle(l).fontWeight, getComputedStyle(l).borderLeftWidth])")
    marked = [text for text, weight, bar in looks if float(weight) >= 600 and bar != "0px"]
    assert len(marked) == 1 and marked[0].startswith("Topic number 26"), looks[:3]

    def menu(title: str):
        page.locator("#conv-list label", has_text=title).first.locator(".qc-menu-btn").click()
        return page.locator(".qc-menu")

    # the menu's Export of another entry downloads that one at once, as Download does
    assert downloaded(menu("Topic number 24 ·").get_by_role("menuitem", name="Export").click) == \
        "Topic number 24.zip"
    assert user_texts(page) == ["Topic number 26"]  # the open conversation stays open

    menu("Topic number 26 ·").get_by_role("menuitem", name="Delete\u2026").click()
    question = page.locator(".qc-menu .qc-question")
    wait_until(lambda: question.is_visible())
    assert "Delete \u201cTopic number 26\u201d" in question.inner_text()
    page.locator(".qc-menu").get_by_role("menuitem", name="Cancel").click()
    wait_until(lambda: page.locator(".qc-menu").count() == 0)
    assert any(s.title == "Topic number 26" for s in history.list())  # Cancel kept it
    menu("Topic number 26 ·").get_by_role("menuitem", name="Delete\u2026").click()
    page.locator(".qc-menu").get_by_role("menuitem", name="Delete", exact=True).click()
    wait_until(lambda: notice_text(page) == "Conversation deleted.")
    assert not any(s.title == "Topic number 26" for s in history.list())
    wait_until(lambda: not any(label.startswith("Topic number 26") for label in sidebar_labels(page)))
    wait_until(lambda: user_texts(page) == [])  # the open conversation is gone: a new chat


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


def test_edited_message_is_resent_and_the_earlier_version_kept(ui):
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
    assert user_texts(page) == ["What is 5+5? <b>quick</b>"]  # the later turn is not shown
    assert "And 3+3" not in bot_text(page)
    assert "the earlier version is kept" in notice_text(page)
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
