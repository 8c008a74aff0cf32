"""The chat page's events: ``wire(page, controller)`` connects the components of a ``Page`` (laid out by
``ui.py``) to ``handlers.ChatController``.

What a user sees follows from these rules:

* a turn (Send / Enter, Regenerate, an edited message) locks the input while it streams: the message box is
  disabled with the placeholder ``WAIT_PLACEHOLDER``, Send and Regenerate are disabled, Stop is enabled (and
  only then); the lock is lifted when the turn ends, is stopped or fails;
* a refused message (too long for the context, model still loading, a bad image) goes back into the message
  box (without the refused image), so nothing typed is lost;
* the sidebar lists a new conversation as soon as its first message is saved, applies the search text of the
  tab to every refresh, and follows the open conversation: its title in the Title box, the export card and
  the delete confirmation hidden on every switch;
* the open conversation's id is kept in the tab's ``sessionStorage``; a reload (Gradio reloads the page after
  a lost connection, e.g. a service restart) reopens it, so the next message joins it;
* the Chatbot's own trash icon starts a new chat (the conversation stays saved), its edit icon resends an
  edited user message, keeping the earlier version (``< 1/2 >`` under the message switches back);
* on a window narrower than ``NARROW_PX`` the sidebar starts closed and closes after a conversation is chosen;
* replies running in the background, the demo banner, the Download button and the user's name:
  ``page_live``; keyboard shortcuts, the edit box and the "service unavailable" banner: ``page_js``; kept
  versions, the list's menu and tag filter, presets: ``page_extras`` (wired by ``ui.py`` after ``wire``).
"""
from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from typing import Any, Optional

import gradio as gr

from qwen_chat.chat_types import ChatError, InvalidImage
from qwen_chat.web.controls import build_settings, preset_values
from qwen_chat.web.handlers import ChatController, Session
from qwen_chat.web.page_live import PLACEHOLDER, WAIT_PLACEHOLDER, list_update, lock_updates, user_of, wire_live
from qwen_chat.web.render import safe_markdown

__all__ = ["NARROW_PX", "PLACEHOLDER", "WAIT_PLACEHOLDER", "Page", "user_of", "warn", "wire"]

log = logging.getLogger(__name__)
#: Below this window width (pixels) the sidebar starts closed: open, it covers the whole chat.
NARROW_PX = 768
STORAGE_KEY = "qwen-chat-open-conversation"
_CLOSE_IF_NARROW = (f"if (window.innerWidth < {NARROW_PX}) "
                    "document.querySelector('#sidebar.open .toggle-button')?.click();")
REMEMBER_JS = (f"(id) => {{ try {{ if (id) sessionStorage.setItem('{STORAGE_KEY}', id); "
               f"else sessionStorage.removeItem('{STORAGE_KEY}'); }} catch (e) {{}} return [id]; }}")
REATTACH_JS = (f"(id) => {{ {_CLOSE_IF_NARROW} let kept = ''; "
               f"try {{ kept = sessionStorage.getItem('{STORAGE_KEY}') || ''; }} catch (e) {{}} "
               "return [id || kept]; }")
CHOSEN_JS = f"(id) => {{ {_CLOSE_IF_NARROW} return [id]; }}"


@dataclass
class Page:
    """The components of the chat page that events read or write (``gr`` components; ``ui._render_*`` fill
    them in, ``wire`` connects them)."""

    page: Any = None  # gr.Blocks
    session: Any = None  # gr.State holding the handlers.Session of this browser tab
    conv_id: Any = None  # hidden Textbox: the open conversation's id ("" for a new chat)
    sidebar: Any = None
    new_btn: Any = None
    search: Any = None
    conv_list: Any = None
    title_box: Any = None
    rename_btn: Any = None
    delete_btn: Any = None
    confirm_row: Any = None  # "Delete ...? [Delete] [Cancel]", shown by the Delete button
    confirm_text: Any = None
    confirm_btn: Any = None
    cancel_btn: Any = None
    export_btn: Any = None  # hidden: the "export" API event (the page downloads with download_btn)
    export_file: Any = None
    download_btn: Any = None  # one click downloads the open conversation as <title>.zip (page_live)
    timer: Any = None  # gr.Timer watching replies left running in the background (page_live)
    user_name: Any = None  # "Logged in as ..." (login on only)
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


def warn(message: str) -> str:
    """Show ``message`` as a warning toast (as literal text: toasts render HTML) and return it as safe Markdown
    for the notice line (messages can quote user input, e.g. an uploaded file's name)."""
    gr.Warning(html.escape(message))
    return safe_markdown(message)


def wire(c: Page, ctl: ChatController) -> list:
    """Connect the events of page ``c`` to ``ctl`` (the rules are in the module docstring).  Returns the events
    after which the open conversation's messages may have changed (the streaming turns and Stop)."""
    sampling = [c.thinking, c.max_new_tokens, c.temperature, c.top_p, c.top_k, c.presence_penalty, c.seed]
    stream_outputs = [c.chatbot, c.conv_id, c.notice, c.msg, c.session, c.conv_list]
    lock_outputs = [c.send_btn, c.regen_btn, c.stop_btn, c.msg]

    def controls(streaming: bool) -> dict:
        return lock_updates(c, streaming)

    def choices(user: str, selected: Optional[str], session: Optional[Session]) -> Any:
        return list_update(ctl, user, selected, session)

    def on_disk(user: str, conv_id: str, notice: str, session: Session, box: Any = None) -> dict:
        """The conversation as saved (after a refused turn); an unknown/foreign id leaves the page empty."""
        try:
            messages = ctl.open(user, conv_id)[0] if conv_id else []
        except ChatError:
            messages, conv_id = [], ""
        shown = {c.chatbot: messages, c.conv_id: conv_id, c.notice: notice, c.session: session,
                 c.conv_list: choices(user, conv_id, session)}
        if box is not None:
            shown[c.msg] = box
        return shown

    def run(turns, user: str, conv_id: str, session: Session, message: Optional[dict] = None,
            first: Optional[dict] = None):
        """Relay ``TurnView``s; a ChatError shows as a notice + toast and the chat shows what is on disk.

        ``message`` (a sent message) leaves the input box with the first update and goes back into it when
        refused, without a refused image (so the next Send does not trip over the same file); ``first``: more
        updates for the first one.  The list is refreshed whenever the conversation id changes (a new
        conversation is listed once saved), once the turn is saved (a follow-up moves its conversation to the
        top, marked as writing) and at the end."""
        shown_id: Optional[str] = None
        try:
            for view in turns:
                update = {c.chatbot: view.messages, c.conv_id: view.conv_id,
                          c.notice: safe_markdown(view.notice), c.session: session}
                if shown_id is None:
                    if message is not None:
                        update[c.msg] = gr.update(value=None)
                    update.update(first or {})
                if view.conv_id != shown_id or view.done or view.saved:  # a follow-up moves to the top at once
                    update[c.conv_list] = choices(user, view.conv_id, session)
                shown_id = view.conv_id
                session.drew(view.conv_id)
                yield update
        except ChatError as e:
            box = None
            if message:
                files = [] if isinstance(e, InvalidImage) else list(message.get("files") or [])
                box = gr.update(value={"text": message.get("text") or "", "files": files})
            yield on_disk(user, conv_id, warn(str(e)), session, box)
            return
        if shown_id is None:  # nothing to send (blank message): only clear an earlier notice
            yield {c.session: session, c.notice: ""}

    def send(message, conv_id, session, system_prompt, thinking, max_new_tokens, temperature, top_p, top_k,
             presence_penalty, seed, request: gr.Request):
        session = session or Session()
        session.tab = getattr(request, "session_hash", "") or session.tab
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
        session.tab = getattr(request, "session_hash", "") or session.tab
        user = user_of(request)
        try:
            settings = build_settings(thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, seed)
        except ChatError as e:
            yield {c.notice: warn(str(e)), c.session: session}
            return
        yield from run(ctl.regenerate(user, conv_id or None, system_prompt or "", settings, session),
                       user, conv_id, session)

    def edit(conv_id, session, system_prompt, thinking, max_new_tokens, temperature, top_p, top_k,
             presence_penalty, seed, evt: gr.EditData, request: gr.Request):
        """The Chatbot's edit: ``evt.index`` is the shown position, ``evt.value`` the edit box's text, as typed
        (the page's script turned the shown ``safe_markdown`` form back, ``page_js``)."""
        session = session or Session()
        session.tab = getattr(request, "session_hash", "") or session.tab
        user = user_of(request)
        index = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        text = evt.value if isinstance(evt.value, str) else ""
        try:
            settings = build_settings(thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, seed)
        except ChatError as e:
            yield on_disk(user, conv_id, warn(str(e)), session)
            return
        turns = ctl.edit(user, conv_id or None, int(index), text, system_prompt or "", settings,
                         session)
        yield from run(turns, user, conv_id, session, first=controls(True))

    def stop(session):
        ctl.stop(session)

    def show_saved(conv_id, session, request: gr.Request):
        """After Stop: show the reply as saved (the cancelled event's last update never reaches the page) and
        list the conversation (a first reply stopped early is listed too)."""
        if not conv_id:
            return gr.skip()
        user = user_of(request)
        try:
            return {c.chatbot: ctl.settled(user, conv_id), c.conv_list: choices(user, conv_id, session)}
        except ChatError:
            return gr.skip()

    def fresh(session, request: gr.Request, notice: str = "") -> dict:
        # a reply this tab's own event shows stops drawing here, even if Gradio's cancel comes late
        ctl.live.leave(getattr(request, "session_hash", "") or getattr(session, "tab", ""))
        if session is not None:
            session.move_to("")
        return {c.chatbot: [], c.conv_id: "", c.notice: notice,
                c.conv_list: choices(user_of(request), None, session), c.title_box: ""}

    def new_chat(session, request: gr.Request):
        return {**fresh(session, request), c.msg: gr.update(value=None)}

    def cleared(session, request: gr.Request):
        return fresh(session, request, "New chat started; the previous conversation is kept in the sidebar.")

    def open_conv(conv_id, session, request: gr.Request):
        if not isinstance(conv_id, str) or not conv_id:
            return gr.skip()  # one skip() leaves every output as it is
        try:
            messages, cid, system_prompt, title = ctl.open(user_of(request), conv_id)
        except ChatError as e:  # unknown or another user's id: an error toast, the page stays as it is
            raise gr.Error(html.escape(str(e))) from None
        if session is not None:
            session.move_to(cid)
        return {c.chatbot: messages, c.conv_id: cid, c.notice: "", c.system_prompt: system_prompt,
                c.title_box: title}

    def reattach(conv_id, request: gr.Request):
        """On page load: reopen the conversation this tab had open (``sessionStorage``), if it still exists."""
        if not isinstance(conv_id, str) or not conv_id:
            return gr.skip()
        user = user_of(request)
        try:
            messages, cid, system_prompt, title = ctl.open(user, conv_id)
        except ChatError:  # deleted meanwhile, or another user logged in on this tab
            return gr.skip()
        return {c.chatbot: messages, c.conv_id: cid, c.system_prompt: system_prompt, c.title_box: title,
                c.conv_list: choices(user, cid, None)}

    def follow(conv_id, request: gr.Request):
        """The open conversation changed: its title in the Title box; no export card or delete question."""
        title = ""
        if conv_id:
            try:
                title = ctl.title(user_of(request), conv_id)
            except ChatError:
                pass
        return {c.title_box: title, c.export_file: gr.update(value=None, visible=False),
                c.confirm_row: gr.update(visible=False)}

    def search(query, conv_id, session, request: gr.Request):
        session = session or Session()
        session.query = query or ""
        return {c.conv_list: choices(user_of(request), conv_id, session), c.session: session}

    def rename(conv_id, title, session, request: gr.Request):
        user = user_of(request)
        try:
            ctl.rename(user, conv_id, title)
        except ChatError as e:
            return {c.notice: warn(str(e))}
        return {c.conv_list: choices(user, conv_id, session), c.notice: safe_markdown(f"Renamed to: {title.strip()}")}

    def ask_delete(conv_id, request: gr.Request):
        try:
            title = ctl.title(user_of(request), conv_id) if conv_id else ""
        except ChatError as e:
            return {c.notice: warn(str(e))}
        if not conv_id:
            return {c.notice: warn("open a conversation first")}
        question = f"Delete \u201c{title}\u201d and its images? This cannot be undone."
        return {c.confirm_row: gr.update(visible=True), c.confirm_text: safe_markdown(question), c.notice: ""}

    def delete(conv_id, session, request: gr.Request):
        user = user_of(request)
        try:
            ctl.delete(user, conv_id)
        except ChatError as e:
            return {c.notice: warn(str(e))}
        if session is not None:
            session.move_to("")
        return {c.chatbot: [], c.conv_id: "", c.conv_list: choices(user, None, session), c.title_box: "",
                c.notice: "Conversation deleted."}

    def export(conv_id, request: gr.Request):
        try:
            return {c.export_file: ctl.export(user_of(request), conv_id), c.notice: ""}
        except ChatError as e:
            return {c.export_file: None, c.notice: warn(str(e))}

    def refresh(conv_id, request: gr.Request):
        return choices(user_of(request), conv_id or None, None)

    private = dict(api_visibility="private", show_progress="hidden")

    def lock(session):
        if session is not None:
            session.stop_asked = False  # a Stop from here on is for the turn this lock starts
        return controls(True)

    def turn(trigger, fn, inputs, api_name: Optional[str]):
        """``trigger`` locks the input controls, runs the streaming ``fn`` and unlocks them at its end."""
        locked = trigger(lock, [c.session], lock_outputs, queue=False, **private)
        named = dict(api_name=api_name) if api_name else dict(api_visibility="private")
        event = locked.then(fn, inputs, stream_outputs, concurrency_limit=None, show_progress="hidden", **named)
        unlock(event)
        return event

    def unlock(event) -> None:
        # .then runs after the end and after a cancel (Stop, New chat, opening another conversation);
        # .failure after an exception.
        for then in (event.then, event.failure):
            then(lambda cid: lock_updates(c, False, bool(cid)), [c.conv_id], lock_outputs, queue=False, **private)

    send_inputs = [c.msg, c.conv_id, c.session, c.system_prompt, *sampling]
    ev_submit = turn(c.msg.submit, send, send_inputs, "send")
    ev_click = turn(c.send_btn.click, send, send_inputs, None)
    ev_regen = turn(c.regen_btn.click, regenerate, [c.conv_id, c.session, c.system_prompt, *sampling],
                    "regenerate")
    # The edit event carries its data (gr.EditData) only to its own listener, so it locks in its first update.
    ev_edit = c.chatbot.edit(edit, [c.conv_id, c.session, c.system_prompt, *sampling],
                             stream_outputs + lock_outputs[:3], concurrency_limit=None, **private)
    unlock(ev_edit)
    ev_edit.then(follow, [c.conv_id], [c.title_box, c.export_file, c.confirm_row], **private)  # a new title
    streams = [ev_submit, ev_click, ev_regen, ev_edit]
    # Stop: flip the session's cancel token at once (unqueued; or as soon as a starting turn has one,
    # ``Session.ask_stop``); the engine stops within one decode step, the turn is saved "stopped" and its event
    # ends by itself with the saved reply.  No Gradio cancel: one that comes before the event has started
    # leaves the chat under a red "Error" badge (Gradio's client fails the submission).
    stopped = c.stop_btn.click(stop, [c.session], None, api_name="stop", queue=False).then(
        show_saved, [c.conv_id, c.session], [c.chatbot, c.conv_list], **private)
    c.new_btn.click(new_chat, [c.session], [c.chatbot, c.conv_id, c.notice, c.msg, c.conv_list, c.title_box],
                    api_name="new_chat", cancels=streams)
    c.chatbot.clear(cleared, [c.session], [c.chatbot, c.conv_id, c.notice, c.conv_list, c.title_box],
                    cancels=streams, **private)
    # preprocess=False: a page that outlived a server restart lists conversations the new process never sent
    # to this session, so Gradio's choice check would refuse them; the store checks ownership on every access.
    # Opening or deleting a conversation closes the event showing a reply of this tab (the reply itself keeps
    # running, ``live_turns``); otherwise its updates would keep drawing over the conversation just opened.
    c.conv_list.input(open_conv, [c.conv_list, c.session], [c.chatbot, c.conv_id, c.notice, c.system_prompt, c.title_box],
                      api_name="open", cancels=streams, preprocess=False, js=CHOSEN_JS)
    c.conv_id.change(follow, [c.conv_id], [c.title_box, c.export_file, c.confirm_row], js=REMEMBER_JS,
                     **private)
    c.search.change(search, [c.search, c.conv_id, c.session], [c.conv_list, c.session], **private)
    c.rename_btn.click(rename, [c.conv_id, c.title_box, c.session], [c.conv_list, c.notice], api_name="rename")
    c.delete_btn.click(ask_delete, [c.conv_id], [c.confirm_row, c.confirm_text, c.notice], **private)
    c.confirm_btn.click(delete, [c.conv_id, c.session], [c.chatbot, c.conv_id, c.conv_list, c.title_box, c.notice],
                        api_name="delete", cancels=streams)
    for button in (c.confirm_btn, c.cancel_btn):
        button.click(lambda: gr.update(visible=False), None, c.confirm_row, queue=False, **private)
    # The file box stays hidden until there is a file in it (a refused export, e.g. no conversation open, has none).
    c.export_btn.click(export, [c.conv_id], [c.export_file, c.notice], api_name="export").then(
        lambda f: gr.update(visible=bool(f)), [c.export_file], c.export_file, api_visibility="private")
    preset_controls = [c.temperature, c.top_p, c.top_k, c.presence_penalty]
    # .input: only the user's own switch (a chat's or a preset's saved settings set the sliders themselves)
    c.thinking.input(lambda t: dict(zip(preset_controls, preset_values(t))), [c.thinking], preset_controls,
                     api_visibility="private")
    c.page.load(refresh, [c.conv_id], [c.conv_list], api_name="conversations").then(
        reattach, [c.conv_id], [c.chatbot, c.conv_id, c.system_prompt, c.title_box, c.conv_list], js=REATTACH_JS,
        **private)
    wire_live(c, ctl, streams, login_enabled=c.user_name is not None)
    return [*streams, stopped]
