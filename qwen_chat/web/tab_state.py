"""What the server keeps per browser tab (``Session``, held in a ``gr.State``), and the rule that keeps a late
update of a closed event from moving the tab back to a conversation it left.

Why the rule is needed: a reply's event draws the chat with every update it yields (``chatbot`` and
``conv_id``).  When the user presses New chat or opens another conversation, Gradio cancels that event and the
server stops drawing (``live_turns.LiveTurns.leave``), but an update the event yielded just before can still
reach the page *after* the New chat's own update: Gradio post-processes and sends each event's updates from
the event's own task, so under load their order on the page is not the order they were made in (seen with
the tiny model on 2 busy cores: 5 of 8 New chat clicks undone this way, the old conversation back on the page
with Stop enabled).  So the tab remembers where it moved (``moved``: from the conversation its own event was
drawing to the one the user chose); while the page shows the conversation it moved away from, the page's timer
(``page_live``) moves it to where the user went, and ``attach`` does not lock the controls for it.  Opening a
conversation from the list, reloading the page, or the tab's own next reply replaces the record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from qwen_chat.chat_types import CancelToken


@dataclass
class Session:
    """Per-browser-tab state (kept in ``gr.State``): the cancel token of the reply running in the conversation
    the tab shows, if any (Stop cancels it), the sidebar's search text (every refresh of the list applies it),
    the tab's id (Gradio's session hash: its replies stop when it is closed) and the running conversations
    the sidebar showed last, the tag filter, the thinking budget and the preset chosen in Settings, and where
    the tab last moved (module docstring)."""

    cancel: Optional[CancelToken] = None
    query: str = ""
    tag: str = ""  # the sidebar's tag filter ("" = every conversation)
    thinking_budget: Optional[int] = None  # the Settings' thinking token budget (None = no budget)
    preset: str = ""  # the preset chosen for this chat, saved with its settings
    tab: str = ""
    shown_running: frozenset = frozenset()
    watching: str = ""  # the conversation whose reply this tab's own event is showing now
    ticked: str = ""  # the conversation whose running reply the page's timer is showing
    redraw: bool = False  # the page's timer draws the open conversation again at its next tick
    drawn: str = ""  # the conversation this tab's own reply event drew last ("" = none yet)
    moved: Optional[tuple[str, str]] = None  # (left, chosen): the tab left ``left`` for ``chosen`` ("" = new chat)
    stop_asked: bool = False  # Stop was pressed for the turn this tab started (``ask_stop``)
    followed: dict = field(default_factory=dict)  # handler name -> the conversation id it last followed

    def opened(self, handler: str, conv_id: Optional[str], skip_stale: bool = False) -> bool:
        """Whether ``conv_id`` differs from what ``handler`` last followed (and remember it).  With
        ``skip_stale``, a conversation shown only by a late update of an event the tab left (``stale``) is not
        an opening and is not remembered: the chat's saved settings must not replace what the user set right
        after New chat, neither when the late update shows the old chat nor when the timer moves the tab back.

        Gradio fires the hidden conversation id's ``change`` for every update of an event that lists it as an
        output, also when the value stays the same (each streamed update, each tick of the page's timer).
        Handlers whose work must happen once per opened conversation (the chat's saved settings, which would
        otherwise undo what the user just set; the download's zip) ask this first."""
        key = conv_id or ""
        if skip_stale and self.stale(key) is not None:
            return False
        if self.followed.get(handler) == key:
            return False
        self.followed[handler] = key
        return True

    def ask_stop(self) -> None:
        """Stop pressed: stop this tab's reply now, or, when its turn has not registered its cancel token yet
        (Stop right after Send, while the prompt is built), as soon as it does: ``ChatController._generate``
        sets ``cancel`` and then reads (and clears) ``stop_asked``; here the flag is set before ``cancel`` is
        read again, so one of the two sees the other."""
        if self._live_token():
            self.cancel.cancel()
            return
        self.stop_asked = True
        if self._live_token():
            self.cancel.cancel()

    def _live_token(self) -> bool:
        return self.cancel is not None and not self.cancel.cancelled

    def move_to(self, conv_id: str) -> None:
        """The user chose ``conv_id`` ("" = a new chat) by New chat, the list or a delete: a late update of the
        reply event that drew another conversation must not bring that one back.  Every handler follows the
        chosen conversation afresh (``opened``), also when it is the one shown: New chat on an empty chat
        starts again from the default settings.  The tab's Stop lets go of the reply it stopped until now (that
        reply goes on in the background; it is taken up again when its conversation is opened), here, at the
        switch: cleared later (by the events the switch fires), it could drop the token of the turn the user
        started meanwhile, and Stop then stopped nothing."""
        self.followed.clear()
        self.cancel = None
        self.stop_asked = False
        left = self.drawn if self.drawn != conv_id else ""
        self.moved = (left, conv_id) if left else None

    def drew(self, conv_id: str) -> None:
        """This tab's own reply event is drawing ``conv_id`` (it was started here, so it is where the user is)."""
        self.drawn = conv_id
        if self.moved is not None and self.moved[0] != conv_id:
            self.moved = (self.moved[0], conv_id)

    def stale(self, conv_id: Optional[str]) -> Optional[str]:
        """Where the page should be instead, when it shows ``conv_id`` only because of a late update of an event
        the tab left (else None).  The id returned may be "" (a new chat)."""
        if self.moved is not None and conv_id and conv_id == self.moved[0]:
            return self.moved[1]
        return None
