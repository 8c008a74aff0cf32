"""``replies_at_once``: several requests streamed from one engine at the same time, for engine tests."""
from __future__ import annotations

import threading

from qwen_chat.chat_types import CancelToken


def replies_at_once(engine, messages, settings: dict, timeout_s: float = 120.0) -> dict:
    """{name: the last update of its reply} for each ``settings`` entry (name -> ``GenerationSettings``), all
    streamed from ``engine.stream_chat(messages, ...)`` at once, one thread each.  Raises AssertionError when a
    reply did not end within ``timeout_s`` seconds (and what a reply raised, in the test's thread)."""
    results, errors = {}, {}

    def run(name, s):
        try:
            results[name] = list(engine.stream_chat(messages, s, CancelToken()))[-1]
        except BaseException as exc:  # noqa: BLE001 - raised again below, in the test's thread
            errors[name] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in settings.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"a reply did not end within {timeout_s} s"
    for exc in errors.values():
        raise exc
    return results
