"""Events of the chat page around the turn itself (wired by ``page_events.wire`` through ``wire_live``):

* ``list_update`` / ``lock_updates``: the sidebar list (search and tag filter applied, running replies marked) and
  the input controls (locked while a reply of the open conversation streams; Regenerate only when there is a
  saved conversation to regenerate in);
* a reply left running in the background (New chat, another conversation opened): a ``gr.Timer``, active only
  while one of the user's replies runs, refreshes the list when a reply ends and shows the open conversation's
  reply live when the user reopened it; reopening such a conversation locks the controls and makes Stop stop
  it; a closed tab (Gradio's ``unload``) stops the replies it started;
* the demo banner follows the Thinking switch and the max new tokens slider;
* the Download button holds the open conversation as ``<title>.zip`` (refreshed when the conversation changes
  and after every turn), so one click downloads it;
* with login on, the user's name next to Log out.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import gradio as gr

from qwen_chat.chat_types import ChatError
from qwen_chat.web.controls import DEMO_MAX_NEW_TOKENS
from qwen_chat.web.handlers import LOCAL_USER, ChatController, Session

log = logging.getLogger(__name__)

PLACEHOLDER = "Ask something, or attach images (JPEG, PNG, GIF, WEBP)"
WAIT_PLACEHOLDER = "Wait for the reply or press Stop"
#: Seconds between the checks of the background replies' timer (while one runs).
TICK_S = 1.0


def demo_badge(thinking: bool, max_new_tokens: Any) -> str:
    """The demo model's banner for the current settings (Markdown)."""
    try:
        tokens = int(float(max_new_tokens))
    except (TypeError, ValueError):
        tokens = DEMO_MAX_NEW_TOKENS
    return (f"**demo model: random weights** - answers are gibberish.  Thinking is {'on' if thinking else 'off'} "
            f"and replies stop after {tokens} tokens (both under Settings); start with a real checkpoint for real "
            f"answers")


def user_of(request: Optional[gr.Request]) -> str:
    """The history owner of a request: the logged-in user name, or ``"local"`` when login is off."""
    name = getattr(request, "username", None) if request is not None else None
    return name or LOCAL_USER


def download_update(ctl: ChatController, user: str, conv_id: Optional[str]) -> Any:
    """The Download button's update: the open conversation as shown now, zipped (``ChatController.download``),
    or a disabled button (no conversation, or the zip could not be made: logged)."""
    if not conv_id:
        return gr.update(value=None, interactive=False)
    try:
        return gr.update(value=ctl.download(user, conv_id), interactive=True)
    except (ChatError, OSError) as e:
        log.warning("download of %s not prepared: %s", conv_id, e)
        return gr.update(value=None, interactive=False)


def list_update(ctl: ChatController, user: str, selected: Optional[str], session: Optional[Session]) -> Any:
    """The sidebar list's update: the user's conversations (the tab's search and tag filter applied, running
    replies marked), ``selected`` chosen if listed.  Remembers in ``session`` which replies it showed running."""
    query = session.query if session is not None else ""
    # The running set is taken before the list is built: a reply that ends in between then differs from what
    # ``tick`` sees next, which draws the list again (taken after, the list kept its "writing…" mark for good).
    running = ctl.live.running(user)
    items = ctl.conversation_choices(user, query, session.tag if session is not None else "")
    if session is not None:
        session.shown_running = running
    shown = query.strip()
    label = ("Saved conversations" if not shown else
             f"Conversations with \u201c{shown}\u201d" if items else f"No conversation has \u201c{shown}\u201d")
    value = selected if selected in {cid for _, cid in items} else None
    return gr.update(choices=items, value=value, label=label)


def lock_updates(c: Any, streaming: bool, can_regenerate: bool = True) -> dict:
    """The input controls of page ``c`` while a reply of the open conversation streams (``streaming``) or not;
    Regenerate needs a saved conversation (``can_regenerate``)."""
    return {c.send_btn: gr.update(interactive=not streaming),
            c.regen_btn: gr.update(interactive=not streaming and can_regenerate),
            c.stop_btn: gr.update(interactive=streaming),
            c.msg: gr.update(interactive=not streaming, placeholder=WAIT_PLACEHOLDER if streaming else PLACEHOLDER)}


def wire_live(c: Any, ctl: ChatController, streams: list, login_enabled: bool) -> None:
    """Connect the events of the module docstring; ``streams``: the events that show a turn."""
    private = dict(api_visibility="private", show_progress="hidden")
    lock = [c.send_btn, c.regen_btn, c.stop_btn, c.msg]

    def attach(conv_id, session, request: gr.Request, switched: bool = True):
        """After the open conversation changed or a turn's event ended: the tab's Stop follows the open
        conversation's running reply (if any; the timer then shows it live), and the timer runs while any reply
        of the user runs."""
        session = session or Session()
        session.tab = getattr(request, "session_hash", "") or session.tab
        switched = session.opened("attach", conv_id) and switched  # (``Session.opened``: not every change is one)
        user = user_of(request)
        turn = ctl.live.find(user, conv_id)
        out = {c.session: session}
        if session.stale(conv_id) is not None:  # a late update brought back a conversation the tab left
            turn = None
            switched = True
        if turn is not None and not turn.cancel.cancelled and session.watching != conv_id:
            session.cancel, session.ticked = turn.cancel, conv_id
            out.update(lock_updates(c, True))
        elif turn is None and (not conv_id or session.watching != conv_id):
            if session.cancel is not None and session.cancel.cancelled:
                session.cancel = None  # (a switch let go of a running one already: ``Session.move_to``)
            out[c.regen_btn] = gr.update(interactive=bool(conv_id))
        if switched:  # the next tick draws the open conversation again (see ``tick``)
            session.redraw = True
        out[c.timer] = gr.Timer(active=switched or bool(ctl.live.running(user)) or bool(session.ticked))
        return out

    def after_turn(conv_id, session, request: gr.Request):
        """After a turn's event ended (or was cancelled: then the open conversation changed too, and the
        change's ``attach`` redraws): ``attach`` without a redraw; the timer stops unless a reply runs."""
        return attach(conv_id, session, request, switched=False)

    def shown(user: str, conv_id: str) -> list:
        """The open conversation as it is now: its running reply live, else as saved ([] for none)."""
        if not conv_id:
            return []
        live = ctl.live_messages(user, conv_id)
        return live if live is not None else ctl.open(user, conv_id)[0]

    def tick(conv_id, session, request: gr.Request):
        """While a reply of the user runs, and once after the open conversation changed: refresh the list when
        the set of running replies changed; show the open conversation's reply live if this tab's own event does
        not, and as saved once it ended; after a switch draw the open conversation again (a cancelled event's
        last update can arrive after New chat / another conversation has drawn the page)."""
        session = session or Session()
        user = user_of(request)
        running = ctl.live.running(user)
        out: dict = {c.session: session}
        target = session.stale(conv_id)
        if target is not None:  # the page shows a conversation the tab left (``tab_state``): back to the chosen one
            try:
                out.update({c.conv_id: target, c.chatbot: shown(user, target),
                            c.conv_list: list_update(ctl, user, target or None, session)})
            except ChatError:  # the chosen one was deleted meanwhile: a new chat
                out.update({c.conv_id: "", c.chatbot: [], c.conv_list: list_update(ctl, user, None, session)})
            out.update(lock_updates(c, False, bool(target)))
            session.ticked, session.redraw = "", True
            out[c.timer] = gr.Timer(active=True)
            return out
        if running != session.shown_running:
            out[c.conv_list] = list_update(ctl, user, conv_id or None, session)
        own = bool(conv_id) and session.watching == conv_id  # this tab's own event shows it
        starting = (session.cancel is not None and not session.cancel.cancelled
                    and session.ticked != conv_id)  # this tab's own turn is starting: it draws the page
        try:
            live = ctl.live_messages(user, conv_id) if conv_id and not own else None
            if live is not None:
                out[c.chatbot] = live
                out.update(lock_updates(c, True))
                turn = ctl.live.find(user, conv_id)
                session.cancel = turn.cancel if turn is not None else session.cancel
                session.ticked = conv_id
            elif (session.ticked or session.redraw) and not own and not starting:  # as saved, unlocked
                out[c.chatbot] = shown(user, conv_id)
                out.update(lock_updates(c, False, bool(conv_id)))
                session.ticked = ""
        except ChatError:  # deleted meanwhile
            session.ticked = ""
        session.redraw = False
        out[c.timer] = gr.Timer(active=bool(running) or bool(session.ticked))
        return out

    def stop_tab(request: gr.Request):
        ctl.close_tab(getattr(request, "session_hash", "") or "")

    def download(conv_id, session, request: gr.Request, again: bool = False):
        if not again and session is not None and not session.opened("download", conv_id, skip_stale=True):
            return gr.skip()  # the same conversation: its zip is there already
        return download_update(ctl, user_of(request), conv_id)

    def download_again(conv_id, session, request: gr.Request):
        """After a turn: the zip holds the new messages."""
        return download(conv_id, session, request, again=True)

    def who(request: gr.Request):
        return f"Logged in as **{user_of(request)}**"

    attach_io = ([c.conv_id, c.session], [c.session, c.timer, *lock])
    c.timer.tick(tick, [c.conv_id, c.session], [c.conv_list, c.chatbot, c.conv_id, c.timer, c.session, *lock],
                 concurrency_limit=None, **private)
    c.page.unload(stop_tab)
    c.conv_id.change(download, [c.conv_id, c.session], [c.download_btn], **private)
    c.conv_id.change(attach, *attach_io, **private)
    for event in streams:
        event.then(download_again, [c.conv_id, c.session], [c.download_btn], **private)
        event.then(after_turn, *attach_io, **private)
    badge_inputs = [c.thinking, c.max_new_tokens]
    for control in badge_inputs:
        control.change(demo_badge, badge_inputs, [c.badge], **private)
    if login_enabled:
        c.page.load(who, None, [c.user_name], **private)
