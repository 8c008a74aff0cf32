"""The per-tab rule that keeps a late update of a closed reply event from moving the tab back to the
conversation it left (``qwen_chat.web.tab_state``)."""
from __future__ import annotations

from qwen_chat.web.tab_state import Session


def test_new_chat_while_a_reply_draws_marks_that_conversation_stale():
    s = Session()
    s.drew("A")  # this tab's reply event drew conversation A
    s.move_to("")  # New chat
    assert s.stale("A") == ""  # a late update showing A: go back to the new chat
    assert s.stale("B") is None and s.stale("") is None and s.stale(None) is None


def test_opening_the_left_conversation_again_is_not_stale():
    s = Session()
    s.drew("A")
    s.move_to("")
    s.move_to("A")  # the user opens A from the list
    assert s.stale("A") is None


def test_the_next_reply_of_the_tab_becomes_where_the_user_is():
    s = Session()
    s.drew("A")
    s.move_to("")
    s.drew("B")  # the user sent a message in the new chat: conversation B
    assert s.stale("A") == "B"
    s.drew("A")  # A's own last update, made before the move, changes nothing
    assert s.stale("A") == "B"


def test_opening_another_conversation_while_a_reply_draws():
    s = Session()
    s.drew("A")
    s.move_to("C")
    assert s.stale("A") == "C" and s.stale("C") is None


def test_a_tab_that_drew_nothing_has_nothing_stale():
    s = Session()
    s.move_to("")
    assert s.moved is None and s.stale("A") is None


def test_stop_while_streaming_cancels_the_token_and_leaves_no_flag():
    from qwen_chat.chat_types import CancelToken

    s = Session(cancel=CancelToken())
    s.ask_stop()
    assert s.cancel.cancelled and not s.stop_asked


def test_settings_typed_after_new_chat_survive_a_late_update_of_the_chat_left():
    """The chat's saved settings load once per opened chat (``Session.opened(..., skip_stale=True)``): a late
    update that shows the chat the tab left, and the timer moving the tab back to the new chat, are no
    openings, so the settings the user typed right after New chat stay."""
    s = Session()
    assert s.opened("settings", "A", skip_stale=True)  # A opened: its settings load
    s.drew("A")  # a reply of A streams
    s.move_to("")  # New chat
    assert s.opened("settings", "", skip_stale=True)  # the new chat: the default settings load once
    assert not s.opened("settings", "A", skip_stale=True)  # A's late update: not an opening
    assert not s.opened("settings", "", skip_stale=True)  # the timer moves the tab back: the typed ones stay
    s.move_to("B")  # the user opens another chat from the list: its settings load
    assert s.opened("settings", "B", skip_stale=True)
    s.move_to("A")  # and A again: an opening now
    assert s.opened("settings", "A", skip_stale=True)
    # without skip_stale the late update counts as an opening (what attach needs to redraw)
    t = Session()
    t.drew("A")
    t.move_to("")
    t.opened("attach", "")
    assert t.opened("attach", "A") and t.opened("attach", "")


def test_a_switch_lets_go_of_the_stop_token_at_once():
    """New chat / opening another chat: the tab's Stop no longer stops the reply left running in the background
    (cleared at the switch itself, so nothing fired later can drop the token of the turn started next)."""
    from qwen_chat.chat_types import CancelToken

    s = Session()
    s.cancel = CancelToken()
    s.move_to("")
    assert s.cancel is None and not s.stop_asked
    started = CancelToken()  # the user's next turn
    s.cancel = started
    s.ask_stop()
    assert started.cancelled
