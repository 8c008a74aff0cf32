"""The Gradio Blocks page: layout (``_render_*``) here, event wiring in ``page_events.py``, behaviour in
``handlers.py``.

The components live in one ``Page`` (named fields, not positions); every event handler returns a dict keyed
by the components it changes (Gradio leaves the other outputs of the event as they are).

The kept versions (``< 2/3 >``, Fork), the conversation list's menu and tag filter, and presets are laid out and
wired by ``page_extras.py`` (with ``presets_view.py``) after ``page_events.wire``.

``build_ui(controller, login_enabled) -> gr.Blocks``.  Only the controller (backend + history store) is
shared between users; everything per user is in ``gr.State`` (the ``Session`` with the Stop token and the
sidebar's search text) or in the page itself (the hidden conversation-id box, so a page that outlives a server
restart still appends to the right conversation on disk; the tab's ``sessionStorage`` keeps that id too, so a
reload, such as Gradio's own after a lost connection, reopens the conversation).  Every event that touches
history resolves the user from ``gr.Request``: ``request.username`` with login on, ``"local"`` with login off.

Rendering is safe by construction: the Chatbot has ``sanitize_html`` on, ``allow_tags`` off, and every text
passes ``render.safe_markdown`` first; math is typeset by Gradio's KaTeX for the delimiters of
``math_render.LATEX_DELIMITERS`` only (never a single ``$``: dollar amounts stay text).
"""
from __future__ import annotations

import gradio as gr

from qwen_chat.chat_types import (
    MAX_NEW_TOKENS_RANGE,
    PRESENCE_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
)
from qwen_chat.web.controls import DEMO_MAX_NEW_TOKENS, page_defaults
from qwen_chat.web import presets_view
from qwen_chat.web.handlers import ChatController, Session
from qwen_chat.web.math_render import LATEX_DELIMITERS
from qwen_chat.web.page_events import PLACEHOLDER, Page, user_of, wire
from qwen_chat.web.page_extras import EXTRA_CSS, Extras, render_hidden, render_tag_filter, wire_extras
from qwen_chat.web.page_js import PAGE_CSS
from qwen_chat.web.page_live import demo_badge

# Case-insensitive in Gradio's server-side check and in the browser's file picker (upper-case .WEBP too).
IMAGE_FILE_TYPES = [".jpg", ".jpeg", ".png", ".gif", ".webp"]
DEMO_BADGE = demo_badge(False, DEMO_MAX_NEW_TOKENS)
API_NOTE = ("Programs can use this service through its OpenAI-compatible API at `/v1` on this address "
            "(`GET /v1/models`, `POST /v1/chat/completions`); see the README, \"OpenAI-compatible API\".")

#: Gradio's own copies of the files the page served (its cache): checked hourly, removed after a day (Gradio's
#: ``delete_cache=(frequency_s, age_s)``); the service's copies behind them: ``file_access.sweep``.
DELETE_CACHE = (3600, 86400)
#: Seconds Gradio's queue loop sleeps while it has nothing to start (Gradio's Linux default, 1 ms, wakes the web
#: front's event loop 1,000 times a second: 5.5 % of a core with nobody connected, measured on the 2-core CPU
#: machine, 2026-12-03), and between its progress checks (default 10 ms; the page shows no progress bars).  A
#: page event waits at most this long more before it starts.
QUEUE_POLL_S = 0.01
PROGRESS_POLL_S = 0.25

CSS = """
#demo-badge {background: #fde68a; color: #78350f; border-radius: 6px; padding: 2px 10px; width: fit-content;}
#demo-badge * {color: #78350f !important;}  /* dark on yellow in the dark theme too */
#notice {min-height: 1.5em;}
#conv-list {max-height: 42vh; overflow-y: auto;}
#conv-list .wrap {flex-direction: column; flex-wrap: nowrap;}
#conv-list .wrap label {width: 100%;}
#api-note {font-size: 0.85em; opacity: 0.8;}
""" + EXTRA_CSS + PAGE_CSS


def _render_sidebar(c: Page, x: Extras, login_enabled: bool) -> None:
    with gr.Sidebar(open=True, label="Conversations", elem_id="sidebar") as c.sidebar:
        if login_enabled:
            with gr.Row():
                c.user_name = gr.Markdown("", elem_id="user-name")
                gr.Button("Log out", link="/logout", size="sm", elem_id="logout", min_width=80)
        c.new_btn = gr.Button("New chat", variant="secondary", elem_id="new-chat")
        c.search = gr.Textbox(label="Search conversations", placeholder="Search titles and messages",
                              show_label=False, max_lines=1,
                              elem_id="search", container=False)
        render_tag_filter(x)
        c.conv_list = gr.Radio(choices=[], value=None, label="Saved conversations", elem_id="conv-list")
        # Hidden: each entry's menu renames and deletes (page.js); these stay for the "rename" / "delete" API.
        c.title_box = gr.Textbox(label="Title", max_lines=1, elem_id="title-box", visible=False)
        with gr.Row(visible=False):
            c.rename_btn = gr.Button("Rename", size="sm", elem_id="rename", min_width=80)
            c.delete_btn = gr.Button("Delete", size="sm", elem_id="delete", min_width=80)
        with gr.Group(visible=False, elem_id="delete-question") as c.confirm_row:
            c.confirm_text = gr.Markdown("", elem_id="delete-question-text")
            with gr.Row():
                c.confirm_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="delete-yes", min_width=80)
                c.cancel_btn = gr.Button("Cancel", size="sm", elem_id="delete-no", min_width=80)
        c.download_btn = gr.DownloadButton("Download (.zip)", size="sm", elem_id="export", interactive=False)
        c.export_btn = gr.Button("Export as zip", visible=False, elem_id="export-api")
        c.export_file = gr.File(label="Export", interactive=False, visible=False, elem_id="export-file")


def _render_chat(c: Page, demo: bool, model_name: str) -> None:
    gr.Markdown(f"## Qwen3.5 chat  \n`{model_name}`", elem_id="page-title")
    c.badge = gr.Markdown(DEMO_BADGE, visible=demo, elem_id="demo-badge")
    c.chatbot = gr.Chatbot(
        label="Chat", elem_id="chatbot", height=420, latex_delimiters=LATEX_DELIMITERS, sanitize_html=True,
        render_markdown=True, allow_tags=False, feedback_options=None, group_consecutive_messages=False,
        editable="user", buttons=["copy", "copy_all"],  # no "share": it posts to Hugging Face discussions
    )
    c.notice = gr.Markdown("", elem_id="notice", latex_delimiters=[])
    c.msg = gr.MultimodalTextbox(
        placeholder=PLACEHOLDER, file_types=IMAGE_FILE_TYPES, file_count="multiple", show_label=False,
        submit_btn=False, elem_id="msg", sources=["upload"],
    )
    with gr.Row():
        c.send_btn = gr.Button("Send", variant="primary", elem_id="send")
        c.stop_btn = gr.Button("Stop", variant="secondary", elem_id="stop", interactive=False)
        c.regen_btn = gr.Button("Regenerate", elem_id="regenerate", interactive=False)


def _render_settings(c: Page, x: Extras, demo: bool) -> None:
    start = page_defaults(demo)
    with gr.Accordion("Settings", open=False, elem_id="settings"):
        c.system_prompt = gr.Textbox(label="System prompt", lines=2, elem_id="system-prompt")
        c.thinking = gr.Checkbox(label="Thinking (reasoning shown in a collapsible block)",
                                 value=start.enable_thinking, elem_id="thinking")
        c.max_new_tokens = gr.Slider(*MAX_NEW_TOKENS_RANGE, value=start.max_new_tokens, step=1,
                                     label="Max new tokens", elem_id="max-new-tokens")
        c.temperature = gr.Slider(*TEMPERATURE_RANGE, value=start.temperature, step=0.05,
                                  label="Temperature (0 = greedy)")
        c.top_p = gr.Slider(*TOP_P_RANGE, value=start.top_p, step=0.01, label="Top-p")
        c.top_k = gr.Slider(*TOP_K_RANGE, value=start.top_k, step=1, label="Top-k")
        c.presence_penalty = gr.Slider(*PRESENCE_PENALTY_RANGE, value=start.presence_penalty, step=0.05,
                                       label="Presence penalty")
        # A Textbox, not gr.Number: Gradio's number field shows an empty value as 0, which made every reply
        # use seed 0 (identical regenerations).  controls.parse_seed turns "" into "fresh random seed".
        c.seed = gr.Textbox(label="Seed (empty: random)", value="", placeholder="random", max_lines=1,
                            elem_id="seed")
        x.presets = presets_view.render()
    gr.Markdown(API_NOTE, elem_id="api-note")


def build_ui(controller: ChatController, max_queue: int = 64, login_enabled: bool = False) -> gr.Blocks:
    """Build the chat page around ``controller``; the caller mounts it (``server.build_app``).

    ``max_queue`` bounds Gradio's queue (further events are refused with a "queue is full" message);
    ``login_enabled`` adds a "Log out" button (Gradio's ``/logout`` route).
    """
    info = controller.backend.info
    c = Page()
    with gr.Blocks(title="Qwen3.5 chat", analytics_enabled=False, delete_cache=DELETE_CACHE) as page:
        c.page = page
        c.session = gr.State(lambda: Session())  # one Session per tab, made at page load, shared by its events
        # "hidden", not False: the box must exist in the browser, where its change event keeps sessionStorage.
        c.conv_id = gr.Textbox(value="", visible="hidden", elem_id="conv-id")
        x = Extras()
        c.timer = gr.Timer(1.0, active=False)
        _render_sidebar(c, x, login_enabled)
        _render_chat(c, info.demo, info.name)
        _render_settings(c, x, info.demo)
        render_hidden(x)
        wire_extras(c, x, controller, wire(c, controller), user_of)
    page.queue(max_size=max_queue, default_concurrency_limit=None)
    queue = getattr(page, "_queue", None)  # Gradio's own Queue: its poll intervals are plain attributes
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = QUEUE_POLL_S
        queue.progress_update_sleep_when_free = PROGRESS_POLL_S
    return page
