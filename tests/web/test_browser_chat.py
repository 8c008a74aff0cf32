"""Real-browser tests of the chat page's statistics, math, background replies and rough edges (headless Debian
chromium, real server, scripted backend):

1. statistics under each reply, live while it streams, equal to the API's usage for the same request, kept
   after a reload;
2. math: ``$$...$$`` typeset by KaTeX, dollar amounts and code left as typed, a broken formula shown as text;
3. a reply keeps generating after New chat and is saved complete; the sidebar marks it meanwhile; reopened
   while it runs, it is shown live with Stop enabled; a closed tab stops its replies;
4. the edit box shows the text as typed; Up edits the last message, Esc stops, Ctrl+Shift+O starts a new chat;
   the demo banner follows the settings; Regenerate only with a conversation; one-click download named after
   the chat; the message box stops growing at its maximum height;
5. phone and desktop, light and dark: Send / Stop and the last lines stay on screen while a reply streams
   (screenshots: a temporary folder, or docs/ with ``QWEN_CHAT_SCREENSHOT_DIR=docs``);
6. login on: the user's name by Log out; the service going away shows "Service unavailable, reconnecting" and
   disables Stop.
"""
from __future__ import annotations

import io
import os
import re
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from qwen_chat.config import ServiceConfig
from qwen_chat.history.export_md import download_name
from qwen_chat.history.store import HistoryStore
from qwen_chat.web.page_js import MSG_MAX_VH
from qwen_chat.web.server import build_app
from tests.support.browsing import (  # noqa: F401 (fixtures)
    bot_text, browser, open_app, open_fresh, page, send, shared_ui_server, sidebar_labels, user_texts, users_file)
from tests.support.fake_backend import FakeBackend
from tests.support.servers import RunningServer
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

LONG_ANSWER = " ".join(f"word{i}" for i in range(120))
STATS = re.compile(r"(\d+) tokens · first token ([\d.]+) s(?: · ([\d.]+) tokens/s)? · prompt (\d+) tokens, (\d+) cached")
SHOTS = os.environ.get("QWEN_CHAT_SCREENSHOT_DIR")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    yield from shared_ui_server(tmp_path_factory)


@pytest.fixture
def ui(service, page):
    """(page, backend, store, running): the page opened on the shared server, its backend reset."""
    running, backend, store = service
    open_fresh(page, running, backend)
    return page, backend, store, running


def stats_lines(pg) -> list[str]:
    return [t.strip() for t in pg.locator("#chatbot .reply-stats").all_inner_texts()]


def idle(pg) -> bool:
    return pg.locator("#send").is_enabled() and not pg.locator("#stop").is_enabled()


def test_statistics_are_live_match_the_api_usage_and_stay_after_a_reload(ui):
    page, backend, store, running = ui
    backend.answer, backend.step_delay_s, backend.cached_tokens = " ".join(f"w{i}" for i in range(30)), 0.05, 3
    send(page, "count the tokens of this question")
    live = wait_until(lambda: STATS.search(" ".join(stats_lines(page))) and not idle(page) and stats_lines(page),
                      what="a statistics line while the reply streams")
    wait_until(lambda: idle(page) and "w29" in bot_text(page))
    [line] = wait_until(lambda: [s for s in stats_lines(page) if s.startswith("30 tokens")], what="final stats")
    tokens, ttft, speed, prompt, cached = STATS.fullmatch(line).groups()
    assert live[0] != line and float(ttft) > 0 and float(speed) > 0
    body = {"model": backend.info.name, "messages": [{"role": "user", "content": "count the tokens of this question"}],
            "max_tokens": 256, "chat_template_kwargs": {"enable_thinking": False}}  # the demo settings
    answer = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert (int(tokens), int(prompt), int(cached)) == (usage["completion_tokens"], usage["prompt_tokens"],
                                                       usage["prompt_tokens_details"]["cached_tokens"])
    page.reload()
    wait_until(lambda: line in stats_lines(page), what="the saved statistics after a reload")


def test_math_renders_while_dollar_amounts_code_and_broken_formulas_stay_text(ui):
    """KaTeX (Gradio's own) is fetched only once a message has a formula: the first load transfers none of it."""
    page, backend, store, running = ui
    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(request.url))
    page.reload()
    page.wait_for_selector("#msg textarea", timeout=60_000)
    assert not [u for u in fetched if "katex" in u.lower() or "auto-render" in u]
    long_sum = "+".join(f"a_{{{{{i}}}}}x^{{{{{i}}}}}" for i in range(60))  # one word: within the token limit
    backend.answer = ("It costs $5 to $12.50 or $20,000 and $30,000. The area is $\\pi r^2$ and "
                      "$$\\int_0^1 x\\,dx$$ Code: `echo $HOME $x$` and broken $$\\frac{{1}}{{$$ and words "
                      "$hello world$ stay end.")
    warnings = []
    page.on("console", lambda m: m.type == "warning" and warnings.append(m.text))
    send(page, "prices and an integral")
    wait_until(lambda: "end." in bot_text(page) and idle(page))
    answer = page.locator("#chatbot [data-testid=bot]").nth(-2)
    wait_until(lambda: answer.locator(".katex").count() >= 2, what="the formulas typeset")
    text = answer.inner_text()
    assert "$5 to $12.50 or $20,000 and $30,000" in text
    assert answer.locator("code").inner_text() == "echo $HOME $x$"
    assert answer.locator("code .katex").count() == 0
    assert "\\frac{1}{" in text  # the broken formula shows as text and the rest of the message renders
    assert "∫" in text
    assert "$hello world$" in text  # words between two dollars are not math

    backend.answer = f"Long: $$S = {long_sum}$$ and Unicode $$x² ≤ 日本 é$$ end two."
    send(page, "a long formula")
    wait_until(lambda: "end two." in bot_text(page) and idle(page))
    answer = page.locator("#chatbot [data-testid=bot]").nth(-2)
    wait_until(lambda: answer.locator(".katex-display").count() == 2, what="both formulas typeset")
    right = answer.bounding_box()["x"] + answer.bounding_box()["width"]
    long_one = answer.locator(".katex-display").first
    box = long_one.bounding_box()
    assert box["x"] + box["width"] <= right + 1, (box, right)  # inside the reply; it scrolls sideways
    assert long_one.evaluate("e => e.scrollWidth > e.clientWidth && getComputedStyle(e).overflowX === 'auto'")
    assert not [w for w in warnings if w.startswith("LaTeX-incompatible input")]

    # a $$ inside code (the shell's process id) and a formula after it: the code block stays whole
    backend.answer = "Run:\n```\necho $$\n```\n\nthen $$x^2$$ end three."
    send(page, "code and a formula")
    wait_until(lambda: "end three." in bot_text(page) and idle(page))
    answer = page.locator("#chatbot [data-testid=bot]").nth(-2)
    wait_until(lambda: answer.locator(".katex").count() == 1, what="the formula after the code typeset")
    assert answer.locator("pre code").inner_text().strip() == "echo $$"
    assert "end three." not in answer.locator("pre").inner_text()
    assert [u for u in fetched if "auto-render" in u]  # now KaTeX was loaded


def test_reply_keeps_generating_after_new_chat_and_is_saved_complete(ui):
    page, backend, store, running = ui
    backend.answer, backend.step_delay_s = LONG_ANSWER, 0.05
    send(page, "A long story in the background")
    wait_until(lambda: "word3" in bot_text(page))
    page.locator("#new-chat").click()
    wait_until(lambda: bot_text(page) == "" and idle(page))
    wait_until(lambda: any(s.startswith("A long story in the background") and s.endswith("writing…")
                           for s in sidebar_labels(page)), what="the sidebar marking the running reply")
    entry = page.locator("#conv-list label", has_text="A long story in the background").first
    entry.locator(".qc-menu-btn").click()  # the entry's menu reads its title without the mark
    page.locator(".qc-menu").get_by_role("menuitem", name="Rename").click()
    rename = entry.locator("input.qc-rename")
    assert rename.input_value() == "A long story in the background"
    rename.press("Escape")
    wait_until(lambda: rename.count() == 0)
    entry.click()  # reopened live
    wait_until(lambda: page.locator("#stop").is_enabled() and "word" in bot_text(page))
    seen = bot_text(page)
    wait_until(lambda: len(bot_text(page)) > len(seen) + 20, what="the reopened reply growing")
    page.locator("#new-chat").click()
    wait_until(lambda: any(s.startswith("A long story in the background") and not s.endswith("writing…")
                           for s in sidebar_labels(page)), timeout_s=60, what="the sidebar after the reply ended")
    history = store.user("local")
    [conv] = [s for s in history.list() if s.title == "A long story in the background"]
    reply = history.load(conv.id).messages[-1]
    assert reply.status == "complete" and reply.text == LONG_ANSWER and reply.stats["completion_tokens"] == 120
    page.locator("#conv-list label", has_text="A long story in the background").first.click()
    wait_until(lambda: "word119" in bot_text(page) and stats_lines(page)[-1].startswith("120 tokens"))


def test_a_closed_tab_stops_its_reply(service, browser):
    running, backend, store = service
    backend.answer, backend.step_delay_s = LONG_ANSWER, 0.05
    context = browser.new_context()
    tab = context.new_page()
    open_app(tab, running.url)
    send(tab, "closed tab story")
    wait_until(lambda: "word3" in bot_text(tab))
    call = backend.calls[-1]
    context.close()
    wait_until(lambda: call.finish_reason in ("cancelled", "closed"), timeout_s=20, what="the engine stopping")
    assert call.steps < 110


def test_edit_box_shortcuts_banner_regenerate_download_and_input_height(ui, tmp_path):
    page, backend, store, running = ui
    assert not page.locator("#regenerate").is_enabled()  # nothing to regenerate yet
    page.locator("#settings").get_by_text("Settings").first.click()
    page.locator("#thinking input[type=checkbox]").check()
    tokens = page.locator("#max-new-tokens input[type=number]")
    tokens.fill("300")
    tokens.press("Enter")
    wait_until(lambda: "Thinking is on and replies stop after 300 tokens" in page.locator("#demo-badge").inner_text())
    page.locator("#settings").get_by_text("Settings").first.click()
    first = "first message"
    send(page, first)
    wait_until(lambda: "You said: first" in bot_text(page) and idle(page))
    typed = "a < b && <b> `x &lt; y`"
    send(page, typed)
    wait_until(lambda: "You said: a < b" in bot_text(page) and idle(page))
    wait_until(lambda: page.locator("#regenerate").is_enabled())
    box = page.locator("#msg textarea")
    box.focus()
    box.press("ArrowUp")  # Up in the empty box edits the last message (not the first), shown as typed
    editor = page.locator("#chatbot textarea.edit-textarea")
    wait_until(lambda: editor.count() == 1 and editor.input_value() == typed, what="the edit box as typed")
    wait_until(lambda: editor.evaluate("e => document.activeElement === e"), what="the typing moved to the edit box")
    editor.press("Escape")  # Esc closes the edit unchanged
    wait_until(lambda: editor.count() == 0, what="Esc closing the edit")
    box.press("ArrowUp")
    wait_until(lambda: editor.count() == 1 and editor.input_value() == typed)
    page.locator("#chatbot button[aria-label=Submit]").click()
    wait_until(lambda: idle(page) and len(store.user("local").list()) > 0)
    history = store.user("local")
    [conv] = [s for s in history.list() if s.title == first]
    wait_until(lambda: history.load(conv.id).messages[2].text == typed)

    with page.expect_download() as download:
        page.locator("#export").click()
    assert download.value.suggested_filename == download_name(first, ".zip")
    path = tmp_path / "download.zip"
    download.value.save_as(path)
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as zf:
        assert {"conversation.json", download_name(first, ".md")} <= set(zf.namelist())
        assert typed in zf.read(download_name(first, ".md")).decode()

    backend.answer, backend.step_delay_s = LONG_ANSWER, 0.05
    send(page, "stop me with Esc")
    wait_until(lambda: "word3" in bot_text(page))
    page.keyboard.press("Escape")
    wait_until(lambda: "[stopped by the user]" in bot_text(page) and idle(page))
    page.keyboard.press("Control+Shift+O")
    wait_until(lambda: user_texts(page) == [] and not page.locator("#regenerate").is_enabled())

    box.fill("x" * 300_000)  # a huge paste: the box stops growing and scrolls
    height = box.evaluate("e => e.getBoundingClientRect().height")
    assert height <= MSG_MAX_VH / 100 * 900 + 2 and box.evaluate("e => e.scrollHeight > e.clientHeight")
    # the buttons stay on a 900 px screen: the column's bottom in page coordinates (whatever the page's scroll)
    bottom = page.evaluate("() => document.querySelector('#send').getBoundingClientRect().bottom + window.scrollY")
    assert bottom <= 900, page.evaluate(
        "() => [...document.querySelectorAll('#page-title,#demo-badge,#chatbot,#msg,#send')].map("
        "e => e.id + ' ' + JSON.stringify(e.getBoundingClientRect()))")
    box.fill("")


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_phone_and_desktop_keep_stop_and_the_last_lines_on_screen(service, browser, tmp_path, theme):
    running, backend, store = service
    backend.answer, backend.step_delay_s = LONG_ANSWER, 0.05
    shots = Path(SHOTS) if SHOTS else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    for name, size in (("phone", {"width": 390, "height": 844}), ("desktop", {"width": 1280, "height": 900})):
        context = browser.new_context(viewport=size)
        try:
            pg = context.new_page()
            open_app(pg, f"{running.url}?__theme={theme}")
            send(pg, f"Tell me a story on a {name}")
            wait_until(lambda: "word40" in bot_text(pg))
            for button in ("#send", "#stop"):
                box = pg.locator(button).bounding_box()
                assert box["y"] + box["height"] <= size["height"], (name, button)
            chat = pg.locator("#chatbot").bounding_box()
            last = pg.locator("#chatbot [data-testid=bot]").last.bounding_box()
            assert last["y"] + last["height"] <= min(chat["y"] + chat["height"], size["height"]) + 2, name
            pg.screenshot(path=str(shots / f"screenshot-{name}-{theme}.png"))
            pg.locator("#stop").click()
            wait_until(lambda: idle(pg))
        finally:
            context.close()


def test_login_shows_the_user_and_a_lost_service_shows_reconnecting(browser, tmp_path):
    users = users_file(tmp_path / "users.txt", {"alice": "alice-password-1"})
    root = tmp_path / "history"
    cfg = ServiceConfig(history_dir=root, login=True, users_file=users)
    context = browser.new_context()
    page = context.new_page()
    try:
        server = RunningServer(build_app(cfg, FakeBackend.for_ui(answer=LONG_ANSWER, step_delay_s=0.1),
                                         HistoryStore(root)))
        with server:
            page.goto(server.url)
            page.locator("input[type=password]").wait_for(timeout=60_000)
            page.locator("input[type=text]").first.fill("alice")
            page.locator("input[type=password]").fill("alice-password-1")
            page.locator("input[type=password]").press("Enter")
            page.wait_for_selector("#msg textarea", timeout=60_000)
            wait_until(lambda: "Logged in as alice" in page.locator("#user-name").inner_text())
            send(page, "a long reply")
            wait_until(lambda: "word5" in bot_text(page))
        banner = page.locator("#service-banner")
        wait_until(lambda: banner.count() == 1 and "Service unavailable, reconnecting" in banner.inner_text(),
                   timeout_s=30, what="the reconnecting banner")
        assert not page.locator("#stop").is_enabled()
    finally:
        context.close()


def test_an_idle_tab_says_when_the_service_is_down_and_keeps_the_box_open(browser, tmp_path):
    """No reply streaming: the tab still notices the lost service within about ``HEALTH_IDLE_POLL_MS``, shows
    the banner, disables Send (no Gradio error for a message that cannot go) and keeps the box open for typing."""
    from qwen_chat.web.page_js import HEALTH_IDLE_POLL_MS

    root = tmp_path / "history"
    context = browser.new_context()
    page = context.new_page()
    try:
        with RunningServer(build_app(ServiceConfig(history_dir=root), FakeBackend.for_ui(), HistoryStore(root))) as s:
            open_app(page, s.url)
            send(page, "hello")
            wait_until(lambda: "You said: hello" in bot_text(page) and page.locator("#send").is_enabled())
        banner = page.locator("#service-banner")
        wait_until(lambda: banner.count() == 1, timeout_s=HEALTH_IDLE_POLL_MS / 1000 + 20,
                   what="the reconnecting banner in an idle tab")
        assert not page.locator("#send").is_enabled()
        box = page.locator("#msg textarea")
        assert box.is_enabled()
        box.fill("typed while the service is down")
        assert box.input_value() == "typed while the service is down"
        box.press("Enter")  # Gradio's own "connection lost" toast would repeat the banner: not shown
        time.sleep(2)
        toasts = page.locator(".toast-body")
        assert toasts.count() == 0 or not toasts.first.is_visible()
    finally:
        context.close()


def test_typing_stays_responsive_with_200_turns_open(ui):
    """A 200-turn conversation (each reply with its statistics line) open: every key typed is in the box and
    painted within 100 ms (95th percentile; keydown to the next animation frame after the input event)."""
    page, backend, store, running = ui
    history = store.user("local")
    conv = history.create()
    stats = {"prompt_tokens": 50, "cached_tokens": 40, "completion_tokens": 30, "ttft_s": 0.2, "tokens_per_s": 40.0}
    for i in range(200):
        history.append_message(conv.id, role="user", text=f"Question {i}: what about $x^{i}$ and `code`?")
        ref = history.append_message(conv.id, role="assistant", text=f"Answer {i}: " + "words " * 40)
        history.update_message(conv.id, ref, stats=stats)
    page.reload()
    page.wait_for_selector("#conv-list label")
    page.locator("#conv-list label", has_text="Question 0").first.click()
    wait_until(lambda: "Answer 199" in bot_text(page), what="the 200 turns shown")
    page.evaluate("""() => {
        window.keyLatencies = [];
        const box = document.querySelector('#msg textarea');
        box.addEventListener('keydown', () => {
            const t0 = performance.now();
            box.addEventListener('input', () => requestAnimationFrame(
                () => window.keyLatencies.push(performance.now() - t0)), {once: true});
        });
    }""")
    text = "typing with a long conversation open"
    page.locator("#msg textarea").focus()
    page.keyboard.type(text)
    assert page.locator("#msg textarea").input_value() == text
    latencies = sorted(page.evaluate("window.keyLatencies"))
    assert len(latencies) == len(text)
    assert latencies[int(0.95 * (len(latencies) - 1))] < 100, latencies
