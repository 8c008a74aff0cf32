"""``CancelToken.on_cancel`` and the async inbox it wakes: an API stream waiting for its next update notices a
cancel at once (Stop, a client gone before the first token), with no timer per wait."""
from __future__ import annotations

import asyncio
import threading

from qwen_chat.chat_types import CancelToken
from qwen_chat.engine.client.engine_client import _Inbox


def test_callbacks_run_once_when_cancelled_and_at_once_when_already_cancelled():
    token, calls = CancelToken(), []
    token.on_cancel(lambda: calls.append("first"))
    token.on_cancel(lambda: calls.append("second"))
    assert calls == [] and not token.cancelled
    token.cancel()
    token.cancel()
    assert calls == ["first", "second"] and token.cancelled
    token.on_cancel(lambda: calls.append("late"))
    assert calls == ["first", "second", "late"]


def test_a_cancel_from_another_thread_wakes_a_waiting_async_consumer():
    async def scenario():
        inbox = _Inbox(asyncio.get_running_loop())
        token = CancelToken()
        token.on_cancel(inbox.wake)
        waiting = asyncio.ensure_future(inbox.wait())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing delivered, nothing cancelled: it sleeps
        threading.Timer(0.05, token.cancel).start()
        await asyncio.wait_for(waiting, timeout=5)
        return token.cancelled

    assert asyncio.run(scenario())


def test_waking_an_inbox_whose_loop_is_closed_is_harmless():
    loop = asyncio.new_event_loop()
    inbox = _Inbox(loop)
    loop.close()
    token = CancelToken()
    token.on_cancel(inbox.wake)
    token.cancel()
    assert token.cancelled
