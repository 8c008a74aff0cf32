"""The Gradio Blocks page: layout (``_render_*``) and event wiring (``_wire``), behaviour in ``handlers.py``.

The components live in one ``Page`` (named fields, not positions); every event handler returns a dict keyed
by the components it changes (Gradio leaves the other outputs of the event as they are).

``build_ui(controller, login_enabled) -> gr.Blocks``.  Only the controller (backend + history store) is
shared between users; everything per user is in ``gr.State`` (the ``Session`` with the Stop token) or in the
page itself (the hidden conversation-id box, so a page that outlives a server restart still appends to the
right conversation on disk).  Every event that touches history resolves the user from ``gr.Request``:
``request.username`` with login on, ``"local"`` with login off.

Rendering is safe by construction: the Chatbot has ``sanitize_html`` on, LaTeX off (dollar amounts stay
text), ``allow_tags`` off, and every text passes ``render.safe_markdown`` first.
"""
from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from typing import Any, Optional

import gradio as gr

from qwen_chat.chat_types import (
    MAX_NEW_TOKENS_RANGE,
    PRESENCE_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
    ChatError,
    InvalidImage,
    GenerationSettings,
)
from qwen_chat.web.handlers import LOCAL_USER, ChatController, Session, build_settings, preset_values
from qwen_chat.web.render import safe_markdown

log = logging.getLogger(__name__)

# Case-insensitive in Gradio's server-side check and in the browser's file picker (upper-case .WEBP too).
IMAGE_FILE_TYPES = [".jpg", ".jpeg", ".png", ".gif", ".webp"]
DEMO_BADGE = "**demo model: random weights** - answers are gibberish; start with a real checkpoint for real answers"

CSS = """
#demo-badge {background: #fde68a; color: #78350f; border-radius: 6px; padding: 2px 10px; width: fit-content;}
#notice {min-height: 1.5em;}
"""


@dataclass
class Page:
    """The components of the chat page that events read or write (``gr`` components; ``_render_*`` fill
    them in, ``_wire`` connects them)."""

    page: Any = None  # gr.Blocks
    session: Any = None  # gr.State holding the handlers.Session of this browser tab
    conv_id: Any = None  # hidden Textbox: the open conversation's id ("" for a new chat)
    new_btn: Any = None
    conv_list: Any = None
    title_box: Any = None
    rename_btn: Any = None
    delete_btn: Any = None
    export_btn: Any = None
    export_file: Any = None
    badge: Any = None
    chatbot: Any = None
    notice: Any = None
    msg: Any = None
    send_btn: Any = None
    stop_btn: Any = None
    regen_btn: Any = None
    system_prompt: Any = None
    thinking: Any = None
    max_new_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    presence_penalty: Any = None
    seed: Any = None


def user_of(request: Optional[gr.Request]) -> str:
    """The history owner of a request: the logged-in user name, or ``"local"`` when login is off."""
    name = getattr(request, "username", None) if request is not None else None
    return name or LOCAL_USER


def warn(message: str) -> str:
    """Show ``message`` as a warning toast (as literal text: toasts render HTML) and return it as safe Markdown
    for the notice line (messages can quote user input, e.g. an uploaded file's name)."""
    gr.Warning(html.escape(message))
    return safe_markdown(message)


def _render_sidebar(c: Page, login_enabled: bool) -> None:
    with gr.Sidebar(open=True, label="Conversations"):
        if login_enabled:
            gr.Button("Log out", link="/logout", size="sm", elem_id="logout")
        c.new_btn = gr.Button("New chat", variant="secondary", elem_id="new-chat")
        c.conv_list = gr.Radio(choices=[], value=None, label="Saved conversations", elem_id="conv-list")
        c.title_box = gr.Textbox(label="Title", max_lines=1, elem_id="title-box")
        with gr.Row():
            c.rename_btn = gr.Button("Rename", size="sm", elem_id="rename")
            c.delete_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="delete")
        c.export_btn = gr.Button("Export as zip", size="sm", elem_id="export")
        c.export_file = gr.File(label="Export", interactive=False, visible=False, elem_id="export-file")


def _render_chat(c: Page, demo: bool, model_name: str) -> None:
    gr.Markdown(f"## Qwen3.5 chat  \n`{model_name}`")
    c.badge = gr.Markdown(DEMO_BADGE, visible=demo, elem_id="demo-badge")
    c.chatbot = gr.Chatbot(
        label="Chat", elem_id="chatbot", height=420, latex_delimiters=[], sanitize_html=True,
        render_markdown=True, allow_tags=False, feedback_options=None, group_consecutive_messages=False,
    )
    c.notice = gr.Markdown("", elem_id="notice", latex_delimiters=[])
    c.msg = gr.MultimodalTextbox(
        placeholder="Ask something, or attach images (JPEG, PNG, GIF, WEBP)", file_types=IMAGE_FILE_TYPES,
        file_count="multiple", show_label=False, submit_btn=False, elem_id="msg", sources=["upload"],
    )
    with gr.Row():
        c.send_btn = gr.Button("Send", variant="primary", elem_id="send")
        c.stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
        c.regen_btn = gr.Button("Regenerate", elem_id="regenerate")


def _render_settings(c: Page) -> None:
    preset = GenerationSettings.preset(True)
    with gr.Accordion("Settings", open=False):
        c.system_prompt = gr.Textbox(label="System prompt", lines=2, elem_id="system-prompt")
        c.thinking = gr.Checkbox(label="Thinking (reasoning shown in a collapsible block)", value=True,
                                 elem_id="thinking")
        c.max_new_tokens = gr.Slider(*MAX_NEW_TOKENS_RANGE, value=preset.max_new_tokens, step=1,
                                     label="Max new tokens")
        c.temperature = gr.Slider(*TEMPERATURE_RANGE, value=preset.temperature, step=0.05,
                                  label="Temperature (0 = greedy)")
        c.top_p = gr.Slider(*TOP_P_RANGE, value=preset.top_p, step=0.01, label="Top-p")
        c.top_k = gr.Slider(*TOP_K_RANGE, value=preset.top_k, step=1, label="Top-k")
        c.presence_penalty = gr.Slider(*PRESENCE_PENALTY_RANGE, value=preset.presence_penalty, step=0.05,
                                       label="Presence penalty")
        # A Textbox, not gr.Number: Gradio's number field shows an empty value as 0, which made every reply
        # use seed 0 (identical regenerations).  handlers.parse_seed turns "" into "fresh random seed".
        c.seed = gr.Textbox(label="Seed (empty: random)", value="", placeholder="random", max_lines=1,
                            elem_id="seed")


def _wire(c: Page, ctl: ChatController) -> None:
    sampling = [c.thinking, c.max_new_tokens, c.temperature, c.top_p, c.top_k, c.presence_penalty, c.seed]
    stream_outputs = [c.chatbot, c.conv_id, c.notice, c.msg, c.session, c.conv_list]

    def choices(user: str, selected: Optional[str]) -> Any:
        return gr.update(choices=ctl.conversation_choices(user), value=selected or None)

    def on_disk(user: str, conv_id: str, notice: str, session: Session, box: Any = None) -> dict:
        """The conversation as saved (after a refused turn); an unknown/foreign id leaves the page empty."""
        try:
            messages = ctl.open(user, conv_id)[0] if conv_id else []
        except ChatError:
            messages, conv_id = [], ""
        shown = {c.chatbot: messages, c.conv_id: conv_id, c.notice: notice, c.session: session,
                 c.conv_list: choices(user, conv_id)}
        if box is not None:
            shown[c.msg] = box
        return shown

    def run(turns, user: str, conv_id: str, session: Session, message: Optional[dict] = None):
        """Relay ``TurnView``s; a ChatError shows as a notice + toast and the chat shows what is on disk.

        A refused image is taken out of the input box (the typed text stays), so the next Send does not
        trip over the same file again."""
        cleared = False
        try:
            for view in turns:
                box = gr.skip() if cleared else gr.update(value=None)
                listed = choices(user, view.conv_id) if (not cleared or view.done) else gr.skip()
                cleared = True
                yield {c.chatbot: view.messages, c.conv_id: view.conv_id, c.notice: safe_markdown(view.notice),
                       c.msg: box, c.session: session, c.conv_list: listed}
        except ChatError as e:
            box = None
            if isinstance(e, InvalidImage) and message:
                box = gr.update(value={"text": message.get("text") or "", "files": []})
            yield on_disk(user, conv_id, warn(str(e)), session, box)
            return
        if not cleared:  # nothing to send (blank message): change nothing on the page
            yield {c.session: session}

    def send(message, conv_id, session, system_prompt, thinking, max_new_tokens, temperature, top_p, top_k,
             presence_penalty, seed, request: gr.Request):
        session = session or Session()
        user = user_of(request)
        message = message or {}
        try:
            settings = build_settings(thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, seed)
        except ChatError as e:
            yield {c.notice: warn(str(e)), c.session: session}
            return
        turns = ctl.send(user, conv_id or None, message.get("text"), message.get("files") or [],
                         system_prompt or "", settings, session)
        yield from run(turns, user, conv_id, session, message)

    def regenerate(conv_id, session, system_prompt, thinking, max_new_tokens, temperature, top_p, top_k,
                   presence_penalty, seed, request: gr.Request):
        session = session or Session()
        user = user_of(request)
        try:
            settings = build_settings(thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, seed)
        except ChatError as e:
            yield {c.notice: warn(str(e)), c.session: session}
            return
        yield from run(ctl.regenerate(user, conv_id or None, system_prompt or "", settings, session),
                       user, conv_id, session)

    def stop(session):
        ctl.stop(session)

    def show_saved(conv_id, request: gr.Request):
        """After Stop: show the reply as saved (the cancelled event's last update never reaches the page)."""
        if not conv_id:
            return gr.skip()
        try:
            return ctl.settled(user_of(request), conv_id)
        except ChatError:
            return gr.skip()

    def new_chat(request: gr.Request):
        return {c.chatbot: [], c.conv_id: "", c.notice: "", c.msg: gr.update(value=None),
                c.conv_list: choices(user_of(request), None), c.title_box: ""}

    def open_conv(conv_id, request: gr.Request):
        if not isinstance(conv_id, str) or not conv_id:
            return gr.skip()  # one skip() leaves every output as it is
        try:
            messages, cid, system_prompt = ctl.open(user_of(request), conv_id)
        except ChatError as e:  # unknown or another user's id: an error toast, the page stays as it is
            raise gr.Error(html.escape(str(e))) from None
        title = dict((v, k) for k, v in ctl.conversation_choices(user_of(request))).get(cid, "")
        return {c.chatbot: messages, c.conv_id: cid, c.notice: "", c.system_prompt: system_prompt,
                c.title_box: title}

    def rename(conv_id, title, request: gr.Request):
        user = user_of(request)
        try:
            ctl.rename(user, conv_id, title)
        except ChatError as e:
            return {c.notice: warn(str(e))}
        return {c.conv_list: choices(user, conv_id), c.notice: safe_markdown(f"Renamed to: {title.strip()}")}

    def delete(conv_id, request: gr.Request):
        user = user_of(request)
        try:
            ctl.delete(user, conv_id)
        except ChatError as e:
            return {c.notice: warn(str(e))}
        return {c.chatbot: [], c.conv_id: "", c.conv_list: choices(user, None), c.title_box: "",
                c.notice: "Conversation deleted."}

    def export(conv_id, request: gr.Request):
        try:
            return {c.export_file: ctl.export(user_of(request), conv_id), c.notice: ""}
        except ChatError as e:
            return {c.export_file: None, c.notice: warn(str(e))}

    def refresh(conv_id, request: gr.Request):
        return choices(user_of(request), conv_id or None)

    send_inputs = [c.msg, c.conv_id, c.session, c.system_prompt, *sampling]
    ev_submit = c.msg.submit(send, send_inputs, stream_outputs, api_name="send", concurrency_limit=None,
                             show_progress="hidden")
    ev_click = c.send_btn.click(send, send_inputs, stream_outputs, api_visibility="private",
                                concurrency_limit=None, show_progress="hidden")
    ev_regen = c.regen_btn.click(regenerate, [c.conv_id, c.session, c.system_prompt, *sampling],
                                 stream_outputs, api_name="regenerate", concurrency_limit=None,
                                 show_progress="hidden")
    # Stop: flip the session's cancel token at once (unqueued) and cancel the Gradio event, which closes the
    # streaming generator; either way the engine stops within one decode step and the turn is saved "stopped".
    c.stop_btn.click(stop, [c.session], None, api_name="stop", queue=False,
                     cancels=[ev_submit, ev_click, ev_regen]).then(
        show_saved, [c.conv_id], [c.chatbot], api_visibility="private", show_progress="hidden")
    c.new_btn.click(new_chat, None, [c.chatbot, c.conv_id, c.notice, c.msg, c.conv_list, c.title_box],
                    api_name="new_chat", cancels=[ev_submit, ev_click, ev_regen])
    # preprocess=False: a page that outlived a server restart lists conversations the new process never sent
    # to this session, so Gradio's choice check would refuse them; the store checks ownership on every access.
    # Opening or deleting a conversation ends a reply still streaming in this tab (saved as stopped); otherwise
    # its updates would keep drawing over the conversation just opened.
    c.conv_list.input(open_conv, [c.conv_list], [c.chatbot, c.conv_id, c.notice, c.system_prompt, c.title_box],
                      api_name="open", cancels=[ev_submit, ev_click, ev_regen], preprocess=False)
    c.rename_btn.click(rename, [c.conv_id, c.title_box], [c.conv_list, c.notice], api_name="rename")
    c.delete_btn.click(delete, [c.conv_id], [c.chatbot, c.conv_id, c.conv_list, c.title_box, c.notice],
                       api_name="delete", cancels=[ev_submit, ev_click, ev_regen])
    c.export_btn.click(export, [c.conv_id], [c.export_file, c.notice], api_name="export").then(
        lambda: gr.update(visible=True), None, c.export_file, api_visibility="private")  # hidden until used
    preset_controls = [c.temperature, c.top_p, c.top_k, c.presence_penalty]
    c.thinking.change(lambda t: dict(zip(preset_controls, preset_values(t))), [c.thinking], preset_controls,
                      api_visibility="private")
    c.page.load(refresh, [c.conv_id], [c.conv_list], api_name="conversations")


def build_ui(controller: ChatController, max_queue: int = 64, login_enabled: bool = False) -> gr.Blocks:
    """Build the chat page around ``controller``; the caller mounts it (``server.build_app``).

    ``max_queue`` bounds Gradio's queue (further events are refused with a "queue is full" message);
    ``login_enabled`` adds a "Log out" button (Gradio's ``/logout`` route).
    """
    info = controller.backend.info
    c = Page()
    with gr.Blocks(title="Qwen3.5 chat", analytics_enabled=False) as page:
        c.page = page
        c.session = gr.State(None)
        c.conv_id = gr.Textbox(value="", visible=False, elem_id="conv-id")
        _render_sidebar(c, login_enabled)
        _render_chat(c, info.demo, info.name)
        _render_settings(c)
        _wire(c, controller)
    page.queue(max_size=max_queue, default_concurrency_limit=None)
    return page
