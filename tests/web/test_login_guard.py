"""The login form's guard (``web/login_guard``) in front of a stand-in of Gradio's ``POST /login`` (the same
form and answers, the guard's ``verify`` as its password check): wrong guesses are limited per user name and,
higher, per client address (429 with ``Retry-After``, nothing hashed; ``X-Forwarded-For`` does not move it), the window passes, a right password clears the
name's count, a form posted from another site is refused 403, and password checks never hold up the event
loop (another route answers while checks are running)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Form, HTTPException
from fastapi.responses import JSONResponse

from qwen_chat.web import login_guard as G
from tests.support.servers import RunningServer

PASSWORDS = {"alice": "alice-password", "bob": "bob-password"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def site():
    checks = []
    hold = threading.Event()      # set: each check waits for ``release`` (a slow bcrypt)
    release = threading.Event()

    def check(user: str, password: str) -> bool:
        checks.append(user)
        if hold.is_set():
            release.wait(30)
        return PASSWORDS.get(user) == password

    clock = Clock()
    guard = G.LoginGuard(check, clock=clock)
    app = FastAPI()

    @app.post("/login")
    async def login(username: str = Form(...), password: str = Form(...)):  # Gradio's route, reduced
        if await guard.verify(username.strip(), password):
            return JSONResponse({"success": True})
        raise HTTPException(status_code=400, detail="Incorrect credentials.")

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    app.add_middleware(G.LoginGuard.Middleware, guard=guard)
    with RunningServer(app) as srv:
        yield srv.url, checks, clock, (hold, release)
        release.set()


def attempt(url: str, user: str, password: str, **headers) -> httpx.Response:
    return httpx.post(url + "/login", data={"username": user, "password": password}, headers=headers, timeout=30)


def test_wrong_guesses_are_limited_per_name_and_the_window_passes(site):
    url, checks, clock, _ = site
    for _ in range(G.MAX_FAILURES):
        assert attempt(url, "alice", "guess").status_code == 400
    hashed = len(checks)
    refused = attempt(url, "alice", PASSWORDS["alice"])     # even the right password waits now
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) == int(G.WINDOW_S)
    assert "try again in" in refused.json()["detail"] and len(checks) == hashed   # nothing hashed
    clock.now += G.WINDOW_S
    assert attempt(url, "alice", PASSWORDS["alice"]).status_code == 200


def test_the_limit_holds_per_address_across_names_and_a_success_clears_the_name(site):
    url, _, clock, _ = site
    for i in range(G.MAX_ADDRESS_FAILURES - 1):                            # each name under its own limit
        assert attempt(url, f"user{i}", "guess").status_code == 400
    assert attempt(url, "bob", PASSWORDS["bob"]).status_code == 200        # others still log in
    assert attempt(url, "bob", "guess").status_code == 400                 # the address's last failure
    assert attempt(url, "bob", PASSWORDS["bob"]).status_code == 429        # every name from this address waits
    spoofed = attempt(url, "bob", PASSWORDS["bob"], **{"x-forwarded-for": "10.1.2.3"})
    assert spoofed.status_code == 429                                       # a forwarded-for header changes nothing
    clock.now += G.WINDOW_S
    for _ in range(G.MAX_FAILURES - 1):
        assert attempt(url, "bob", "guess").status_code == 400
    assert attempt(url, "bob", PASSWORDS["bob"]).status_code == 200        # clears bob's count
    assert attempt(url, "bob", "guess").status_code == 400


def test_a_login_form_posted_from_another_site_is_refused(site):
    url, checks, _, _ = site
    host = url.split("://", 1)[1]
    r = attempt(url, "alice", PASSWORDS["alice"], origin="https://evil.example.com")
    assert r.status_code == 403 and "another site" in r.json()["detail"] and not checks
    assert attempt(url, "alice", PASSWORDS["alice"], origin=f"http://{host}").status_code == 200
    proxied = attempt(url, "alice", PASSWORDS["alice"], origin="https://chat.example.org",
                      **{"x-forwarded-host": "chat.example.org"})   # behind a reverse proxy
    assert proxied.status_code == 200


def test_password_checks_never_hold_up_other_requests(site):
    """Checks that do not finish until released (one more than ``HASH_THREADS``, which waits for a thread):
    another route still answers meanwhile (were the checks on the event loop, it could not answer before the
    release)."""
    url, checks, _, (hold, release) = site
    hold.set()
    threads = [threading.Thread(target=attempt, args=(url, f"u{i}", "guess")) for i in range(G.HASH_THREADS + 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(checks) < G.HASH_THREADS and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(checks) == G.HASH_THREADS          # as many checks as threads are running now; one more waits
    assert httpx.get(url + "/healthz", timeout=10).status_code == 200
    release.set()
    for t in threads:
        t.join(30)


def test_guesses_sent_all_at_once_get_no_more_checks_than_the_limit(site):
    """Twelve wrong guesses for one name sent at once, while every check is held: only ``MAX_FAILURES`` of them
    reach the password check, the rest are 429 (counted after the check, each guess in flight got one more);
    a guess that is then answered 200 takes its count back."""
    url, checks, clock, (hold, release) = site
    hold.set()
    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(attempt(url, "alice", "guess").status_code))
               for _ in range(12)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(answers) < 12 - G.MAX_FAILURES and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(30)
    assert sorted(answers) == [400] * G.MAX_FAILURES + [429] * (12 - G.MAX_FAILURES)
    assert len(checks) == G.MAX_FAILURES
    hold.clear()
    clock.now += G.WINDOW_S
    assert attempt(url, "bob", PASSWORDS["bob"]).status_code == 200  # a right password is not left counted
    for i in range(G.MAX_ADDRESS_FAILURES - 1):
        assert attempt(url, f"x{i}", "guess").status_code == 400
    assert attempt(url, "bob", PASSWORDS["bob"]).status_code == 200  # the address has one wrong try left
