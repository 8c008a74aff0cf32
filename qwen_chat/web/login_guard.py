"""The login form's guard: password checks off the event loop, a limit on wrong guesses, no cross-site logins.

Gradio's ``POST /login`` (the page's login form) calls the service's password check.  Unguarded, each check
(bcrypt, about 0.2 s of CPU) ran on the event loop, so 60 wrong guesses delayed another user's request by 14.5 s
and ``/healthz`` by 7.9 s (2 CPU cores, 2026-12-01); any number of guesses were allowed; and a page of another
site could post the form and log the user's browser into the attacker's account (login CSRF).  So:

- ``LoginGuard.verify`` (given to Gradio as its async ``auth``) runs the check in a worker thread, at most
  ``HASH_THREADS`` at once (half the cores; bcrypt releases the GIL, so the loop and the other requests go on);
- ``LoginGuard.middleware`` answers a ``POST /login`` with 429 (``Retry-After``, a message naming the wait)
  when its user name had ``MAX_FAILURES`` wrong attempts in the last ``WINDOW_S`` seconds, or its client
  address ``MAX_ADDRESS_FAILURES``, before anything is hashed; an attempt counts as wrong from the moment it
  is let through until its answer says otherwise (so guesses sent all at once get no more checks than
  guesses sent one by one); a successful login clears the name's count;
- the same middleware refuses with 403 a login form posted from another origin (its ``Origin`` header is not
  the service's own ``Host``), before anything is read.

The client address is the TCP peer's (uvicorn runs with ``proxy_headers=False``: an ``X-Forwarded-For`` does not
change it; a reverse proxy in front makes every user one address: its limit is then shared, the per-name limit
still holds).
"""
from __future__ import annotations

import collections
import json
import math
import os
import threading
import time
from typing import Callable, Optional
from urllib.parse import parse_qs

import anyio

from qwen_chat.web.origins import same_origin

#: Wrong attempts allowed per user name, and per client address, within ``WINDOW_S`` seconds.  The address's
#: limit is higher: users behind one NAT or proxy share it, and one of them guessing must not lock out the rest
#: for long.
MAX_FAILURES = 5
MAX_ADDRESS_FAILURES = 20
WINDOW_S = 60.0
#: Password checks running at once: half the cores this process may use, at least one (each check takes one core
#: for about 0.2 s at bcrypt cost 12).  With both cores of a 2-core machine hashing, 60 guesses at once (each for
#: another name from another address, so no limit applies) delayed another user's 4-token request by 1.1-1.7 s
#: in three runs (bench/auth_sweep.py, 2026-12-02); half the cores leaves the rest to the users' requests.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
HASH_THREADS = max(1, _CORES // 2)
#: Paths of Gradio's login form (the UI is mounted at "/").
LOGIN_PATHS = ("/login", "/login/")
#: Largest login form body read (bytes): a user name and a password of at most 72 bytes fit many times over.
MAX_FORM_BYTES = 16 * 1024


class _Failures:
    """Times of wrong attempts per key within the window (thread-safe)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._times: dict[str, collections.deque] = {}
        self._lock = threading.Lock()

    def _recent(self, key: str, now: float) -> collections.deque:
        times = self._times.get(key)
        if times is None:
            return collections.deque()
        while times and now - times[0] >= WINDOW_S:
            times.popleft()
        if not times:
            del self._times[key]
        return times

    def wait_s(self, key: str, limit: int) -> float:
        """Seconds until ``key`` (with ``limit`` failures allowed in the window) may try again (0.0: now)."""
        with self._lock:
            now = self._clock()
            times = self._recent(key, now)
            return WINDOW_S - (now - times[-limit]) if len(times) >= limit else 0.0

    def add(self, key: str) -> float:
        """Count a wrong attempt of ``key`` now; returns its time (for ``discard``)."""
        with self._lock:
            now = self._clock()
            self._times.setdefault(key, collections.deque()).append(now)
            return now

    def discard(self, key: str, when: float) -> None:
        """Take back the attempt of ``key`` counted at ``when`` (``add``'s answer), if still counted."""
        with self._lock:
            times = self._times.get(key)
            if times is not None and when in times:
                times.remove(when)
                if not times:
                    del self._times[key]

    def clear(self, key: str) -> None:
        with self._lock:
            self._times.pop(key, None)


class LoginGuard:
    """Guard of the login form around ``check(username, password) -> bool`` (``auth.UserDB.verify``).

    ``clock``: seconds, monotonic (tests pass their own).  Use ``verify`` as Gradio's ``auth`` and add
    ``middleware`` to the app (``app.add_middleware(LoginGuard.Middleware, guard=guard)``)."""

    def __init__(self, check: Callable[[str, str], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._limiter = anyio.CapacityLimiter(HASH_THREADS)
        self.failures = _Failures(clock)

    async def verify(self, username: str, password: str) -> bool:
        """``check`` in a worker thread (at most ``HASH_THREADS`` at once): the event loop keeps serving."""
        return await anyio.to_thread.run_sync(self._check, username, password, limiter=self._limiter)

    class Middleware:
        """ASGI middleware of ``LoginGuard`` (module docstring) for ``POST /login``; everything else passes."""

        def __init__(self, app, guard: "LoginGuard") -> None:
            self.app, self.guard = app, guard

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LOGIN_PATHS:
                await self.app(scope, receive, send)
                return
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            origin = headers.get("origin")
            if origin is not None and not same_origin(origin, headers):
                await _answer(send, 403, "Log in from this service's own page: a login form posted from another "
                                         "site is refused.")
                return
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > MAX_FORM_BYTES:
                    await _answer(send, 413, "The login form is too large.")
                    return
            form = parse_qs(body.decode("utf-8", "replace")) if body else {}
            name = (form.get("username") or [""])[0].strip()
            address = (scope.get("client") or ("?", 0))[0]
            keys = [f"address:{address}", f"user:{name}"]
            wait = max(self.guard.failures.wait_s(keys[0], MAX_ADDRESS_FAILURES),
                       self.guard.failures.wait_s(keys[1], MAX_FAILURES))
            if wait > 0:
                seconds = max(1, math.ceil(wait))
                await _answer(send, 429, f"Too many wrong logins: try again in {seconds} s.",
                              {"retry-after": str(seconds)})
                return
            # Counted as wrong before the check, so that guesses sent at once see each other (counted after it,
            # n guesses in parallel got n - 1 checks over the limit); taken back unless the answer is a 4xx.
            counted = [(key, self.guard.failures.add(key)) for key in keys]
            status: list[Optional[int]] = [None]

            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:  # after the body: what the client does next (a disconnect)
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            async def watch(message) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await self.app(scope, replay, watch)
            finally:
                if status[0] is None or not 400 <= status[0] < 500:
                    for key, when in counted:
                        self.guard.failures.discard(key, when)
                if status[0] == 200:
                    self.guard.failures.clear(keys[1])


async def _answer(send, status: int, message: str, headers: Optional[dict] = None) -> None:
    """A JSON ``{"detail": message}`` answer (the shape of Gradio's own login errors)."""
    body = json.dumps({"detail": message}).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + extra})
    await send({"type": "http.response.body", "body": body})
