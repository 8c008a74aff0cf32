"""Replies that keep generating when the page looks elsewhere: each accepted turn runs in its own thread.

A reply no longer lives inside the Gradio event that shows it.  ``LiveTurn`` reads the backend's stream in a
thread of its own, saves it through ``history.turns.ReplyRecorder`` (with its ``reply_stats``) and finishes it
with its status; the page's event only *watches* it (``LiveTurn.wait``).  So:

* New chat, another conversation opened, the trash icon or a reload of the list close the watching event, and
  the reply goes on to its end and is saved complete (as ChatGPT does); reopening the conversation watches it
  again (``LiveTurns.find``);
* Stop cancels the reply's ``CancelToken`` (saved ``stopped``); a closed tab (Gradio's ``unload``) cancels the
  replies that tab started (``LiveTurns.close_tab``), so generation still ends within a decode step of Stop or
  of a closed tab;
* the sidebar marks the conversations of a user that have a reply running (``LiveTurns.running``);
* a save the disk refuses (history folder not writable, disk full) never ends the reply or keeps the tab
  busy: the page shows ``save_note`` (no server path), the turn ends as usual, and a final save that failed is
  tried again in the turn's thread until the folder is writable (``turns.ReplyRecorder.save_later``), while
  every view of the conversation shows the reply as generated (``LiveTurns.unsaved``: this tab's event, the
  page's timer, reopening it, another tab) until it is saved.

A browser tab may have at most ``MAX_RUNNING_PER_TAB`` replies running at once (``InvalidInput`` for one more),
one per conversation.  No Gradio objects here; thread-safe.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

from qwen_chat.chat_types import CancelToken, ChatError, InvalidInput, StreamUpdate
from qwen_chat.history.records import StoredMessage
from qwen_chat.history.reply_stats import ReplyStats
from qwen_chat.history.turns import STOPPED, ReplyRecorder, reply_status

log = logging.getLogger(__name__)

#: Replies one browser tab may have generating at once (each holds an engine sequence until it ends).
MAX_RUNNING_PER_TAB = 4


class LiveTurn:
    """One reply being generated in its own thread.

    Args:
        user: the history owner; ``conv_id``: its conversation; ``tab``: the browser tab that started it (Gradio's
            session hash; "" for none).
        recorder: the ``ReplyRecorder`` saving it; ``stats``: its ``ReplyStats`` (timed from the request).
        first: the first ``StreamUpdate`` (already read by the caller, None for none); ``stream``: the rest.
        cancel: the turn's ``CancelToken`` (Stop); ``notes``: the notice of the turn (edited message...).
        on_end: called with the turn once it is saved (the registry forgets it).
    """

    def __init__(self, user: str, conv_id: str, tab: str, recorder: ReplyRecorder, stats: ReplyStats,
                 first: Optional[StreamUpdate], stream: Iterator[StreamUpdate], cancel: CancelToken, notes: str,
                 on_end: Callable[["LiveTurn"], None]) -> None:
        self.user, self.conv_id, self.tab = user, conv_id, tab
        self.recorder, self.stats, self.cancel, self.notes = recorder, stats, cancel, notes
        self._updates = itertools.chain([first] if first is not None else [], stream)
        self._stream = stream
        self._on_end = on_end
        self._cond = threading.Condition()
        self.version = 0  # bumped by every update (watchers wait for a newer one)
        self.last = StreamUpdate()
        self.done = False
        self.notice = ""  # the final notice once done
        # the reply as generated while its final save is refused (None once saved, or never refused)
        self.unsaved: Optional[StoredMessage] = None
        self.thread = threading.Thread(target=self._run, name=f"reply-{conv_id[:8]}", daemon=True)

    def start(self) -> None:
        """Start generating in the turn's thread."""
        self.thread.start()

    def snapshot(self) -> tuple[int, StreamUpdate, dict, bool]:
        """(version, latest update, statistics record, done) at one instant."""
        with self._cond:
            return self.version, self.last, self.stats.record(), self.done

    def wait(self, version: int, timeout_s: float) -> None:
        """Block until an update newer than ``version`` arrived or the turn ended, at most ``timeout_s`` s."""
        with self._cond:
            if self.version == version and not self.done:
                self._cond.wait(timeout_s)

    def wait_done(self, timeout_s: float) -> bool:
        """Block until the turn ended (its final save tried), at most ``timeout_s`` seconds; True if it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done, timeout_s)

    def _publish(self, update: StreamUpdate, done: bool = False) -> None:
        with self._cond:
            self.last = update
            self.version += 1
            self.done = done or self.done
            self._cond.notify_all()

    def save_note(self) -> str:
        """What the page says while the disk refuses this reply's saves ("" while they succeed)."""
        failure = self.recorder.failure
        return f"{failure}; the reply is saved as soon as it is writable again" if failure else ""

    def _run(self) -> None:
        last, status, error_text, saved = StreamUpdate(), STOPPED, "", True
        try:
            for update in self._updates:
                self.stats.see(update)
                last = update
                if update.done:
                    break
                self.recorder.progress(update, self.stats.record())
                self._publish(update)
            status = reply_status(last.finish_reason, stopped_by_user=self.cancel.cancelled)
        except ChatError as e:
            status, error_text = "error", str(e)
        except Exception as e:  # noqa: BLE001 - an engine fault must not lose the saved turn
            log.exception("generation failed")
            status, error_text = "error", f"{type(e).__name__}: {e}"
        finally:
            getattr(self._stream, "close", lambda: None)()
            self.notice = "; ".join(x for x in (self.notes, last.notice, error_text) if x)
            try:
                record = self.stats.record()
                saved = self.recorder.finish(last, status, self.notice, record)
                if not saved:
                    self.unsaved = StoredMessage(self.recorder.ref.message_id, "assistant", last.answer,
                                                 reasoning=last.reasoning, status=status, notice=self.notice,
                                                 stats=record)
                    self.notice = "; ".join(x for x in (self.notice, self.save_note()) if x)
            finally:
                self._on_end(self)
                self._publish(last, done=True)
        if not saved:
            self.recorder.save_later()
            self.unsaved = None  # saved (or given up after SAVE_RETRY_FOR_S: the file's version is what lasts)


class LiveTurns:
    """The replies running now, by (user, conversation id) (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns: dict[tuple[str, str], LiveTurn] = {}
        self._unsaved: dict[tuple[str, str], LiveTurn] = {}  # ended turns whose final save is still refused
        self._left: dict[str, float] = {}  # browser tab -> time.monotonic() it last started a new chat

    def leave(self, tab: str) -> None:
        """Browser tab ``tab`` started a new chat: the events showing its replies stop drawing (``left_since``),
        even when Gradio's cancel of those events arrives late or not at all (their replies keep running)."""
        if tab:
            self._left[tab] = time.monotonic()

    def left_since(self, tab: str, t0: float) -> bool:
        """Whether tab ``tab`` started a new chat after ``t0`` (``time.monotonic()`` seconds)."""
        return bool(tab) and self._left.get(tab, -1.0) > t0

    def check_room(self, user: str, conv_id: Optional[str], tab: str = "") -> None:
        """Refuse a new turn in ``user``'s ``conv_id`` while its reply is still running, or beyond
        ``MAX_RUNNING_PER_TAB`` running replies started by browser tab ``tab`` (none counted for "").
        Raises ``InvalidInput``."""
        with self._lock:
            if conv_id and (user, conv_id) in self._turns:
                raise InvalidInput("a reply is still being written in this conversation: wait for it or press Stop")
            if tab and sum(1 for t in self._turns.values() if t.tab == tab) >= MAX_RUNNING_PER_TAB:
                raise InvalidInput(f"{MAX_RUNNING_PER_TAB} replies are being written at once already: wait for "
                                   "one of them or stop it")

    def add(self, turn: LiveTurn) -> None:
        """Register ``turn`` (under its user and conversation) and start it."""
        with self._lock:
            self._turns[(turn.user, turn.conv_id)] = turn
        turn.start()

    def forget(self, turn: LiveTurn) -> None:
        """Drop ``turn`` from the running replies (called by the turn once its final save was tried); one whose
        final save the disk refused (``LiveTurn.unsaved``) stays known to ``unsaved`` until it is saved."""
        key = (turn.user, turn.conv_id)
        with self._lock:
            if self._turns.get(key) is turn:
                del self._turns[key]
            for old in [k for k, t in self._unsaved.items() if t.unsaved is None]:
                del self._unsaved[old]
            if turn.unsaved is not None:
                self._unsaved[key] = turn

    def unsaved(self, user: str, conv_id: Optional[str]) -> Optional[StoredMessage]:
        """The last ended reply of ``user``'s ``conv_id`` as generated, while the disk still refuses its final
        save (its ``id`` is the saved message's, which holds an older version); None when there is none."""
        with self._lock:
            turn = self._unsaved.get((user, conv_id or ""))
            return turn.unsaved if turn is not None else None

    def find(self, user: str, conv_id: Optional[str]) -> Optional[LiveTurn]:
        """The reply running in ``user``'s conversation ``conv_id``, or None."""
        with self._lock:
            return self._turns.get((user, conv_id or ""))

    def shown(self, user: str, conv: Any) -> list:
        """``conv``'s saved messages (a ``records.Conversation`` of ``user``), with a reply whose final save the
        disk still refuses (``unsaved``) shown as generated in place of its older saved version."""
        unsaved = self.unsaved(user, conv.id)
        index = conv.index_of(unsaved.id) if unsaved is not None else None
        if index is None:
            return conv.messages
        return [*conv.messages[:index], unsaved, *conv.messages[index + 1:]]

    def running(self, user: str) -> frozenset:
        """Ids of ``user``'s conversations with a reply running now."""
        with self._lock:
            return frozenset(c for u, c in self._turns if u == user)

    def close_tab(self, tab: str) -> int:
        """Stop every reply started by browser tab ``tab`` (it was closed); returns how many."""
        if not tab:
            return 0
        with self._lock:
            turns = [t for t in self._turns.values() if t.tab == tab]
        for turn in turns:
            turn.cancel.cancel()
        return len(turns)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no reply runs (tests, shutdown); True when none does within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._turns:
                    return True
            time.sleep(0.02)
        with self._lock:
            return not self._turns


def watch(turn: LiveTurn, interval_s: float) -> Iterator[tuple[StreamUpdate, dict]]:
    """Yield (latest update, statistics record) of ``turn`` whenever it changed, at most every ``interval_s``
    seconds, until it ends; closing this generator leaves the turn running."""
    seen = -1
    while True:
        version, update, stats, done = turn.snapshot()
        if done:
            return
        if version != seen:
            seen = version
            yield update, stats
            if interval_s > 0:
                time.sleep(interval_s)
        turn.wait(seen, 1.0)
