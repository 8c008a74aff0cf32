"""Login and per-user isolation on the real service (``start.sh``, tiny model, ``--login --users-file``).

One service for the module, started with a users file made by the CLI (alice) and by ``auth.UserDB`` (bob),
upload limits of 1 MB per file and 2 images per message.  Driven like a browser would be: ``gradio_client``
sessions with their own login cookies, and plain HTTP for the routes Gradio exposes.

* unauthenticated access to the UI, its API, uploads and files is refused; a wrong password does not log in;
* alice and bob chat at the same time (both streams in the engine at once): each gets exactly the reply their
  own prompt gets when run alone (greedy decoding), saved only in their own folder;
* bob cannot open, rename, delete, export or append to alice's conversation by its id, by a guessed id or by a
  path, nor fetch her files through Gradio's file route; alice's file is byte-for-byte unchanged;
* upload count and size limits answer with a message naming the limit, and nothing is saved.

(200 concurrent saves to one store are covered by tests/unit/test_history.py.)
"""
from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError, AuthenticationError
from PIL import Image

from qwen_chat.history.store import HistoryStore
from qwen_chat.web import auth
from tests.support.service_harness import (
    REPO,
    UI_CONTROLS,
    ServiceProcess,
    health,
    history_files,
    service_argv,
    wait_healthy,
)
from tests.support.servers import free_port

pytestmark = [
    pytest.mark.slow,  # reason: starts the real service (tiny model) through start.sh, ~30-60 s start-up
    pytest.mark.timeout(600),
]

FIXTURES = REPO / "tests" / "fixtures" / "images"
USERS = {"alice": "alice-password-1", "bob": "bob-password-22"}
MAX_UPLOAD_MB = 1
MAX_IMAGES = 2


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_checkpoint):
    """(base url, history dir) of a running service with login on."""
    work = tmp_path_factory.mktemp("users")
    users_file = work / "users.txt"
    # alice through the operator's CLI (password on stdin), bob through the library.
    done = subprocess.run([sys.executable, "-m", "qwen_chat.web.auth", "add", "alice", "--users-file",
                           str(users_file), "--rounds", "4"], input=USERS["alice"] + "\n", text=True,
                          capture_output=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and "added user alice" in done.stdout, done.stderr
    db = auth.UserDB.from_file(users_file)
    db.set_password("bob", USERS["bob"], rounds=4)
    db.save()
    port = free_port()
    history = work / "history"
    argv = service_argv(port, history, Path(tiny_checkpoint).parent, "--login", "--users-file", str(users_file),
                        "--max-upload-mb", str(MAX_UPLOAD_MB), "--max-images-per-turn", str(MAX_IMAGES))
    with ServiceProcess(argv, work / "service.log") as svc:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, timeout_s=240)
        except TimeoutError:
            pytest.fail(f"service did not become healthy; log tail:\n{svc.log_text()[-3000:]}")
        yield url, history, users_file


def login(url: str, user: str) -> Client:
    return Client(url + "/", auth=(user, USERS[user]), verbose=False)


def http_session(url: str, user: str) -> httpx.Client:
    """An HTTP session holding ``user``'s login cookie (Gradio's ``POST /login`` form)."""
    s = httpx.Client(base_url=url, timeout=30)
    r = s.post("/login", data={"username": user, "password": USERS[user]})
    assert r.status_code == 200, r.text
    return s


def send(client: Client, text: str, files=(), conv_id: str = "", max_new_tokens: int = 64):
    controls = list(UI_CONTROLS)
    controls[1] = max_new_tokens
    return client.predict({"text": text, "files": [handle_file(str(f)) for f in files]}, conv_id, "", *controls,
                          api_name="/send")


def submit(client: Client, text: str, max_new_tokens: int):
    controls = list(UI_CONTROLS)
    controls[1] = max_new_tokens
    return client.submit({"text": text, "files": []}, "", "", *controls, api_name="/send")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_unauthenticated_access_is_refused(service):
    url, history, users_file = service
    with pytest.raises(AuthenticationError):
        Client(url + "/", verbose=False)
    with pytest.raises(ValueError, match="Could not login"):
        Client(url + "/", auth=("alice", "not-her-password"), verbose=False)
    with pytest.raises(ValueError, match="Could not login"):
        Client(url + "/", auth=("mallory", "some-password"), verbose=False)
    anonymous = httpx.Client(base_url=url, timeout=30)
    assert anonymous.get("/gradio_api/info").status_code == 401
    assert anonymous.get("/config").status_code == 401
    join = anonymous.post("/gradio_api/queue/join", json={"data": [], "fn_index": 0, "session_hash": "x"})
    assert join.status_code == 401
    assert anonymous.post("/gradio_api/upload", files={"files": ("a.png", b"x", "image/png")}).status_code == 401
    assert anonymous.post("/login", data={"username": "bob", "password": "wrong-password"}).status_code != 200
    # health and metrics stay open for monitoring; they carry no conversation data
    assert anonymous.get("/healthz").status_code == 200
    assert anonymous.get("/metrics").status_code == 200
    # the users file holds bcrypt hashes only, readable by its owner only
    text = users_file.read_text()
    assert all(pw not in text for pw in USERS.values()) and text.count(":$2b$04$") == 2
    assert users_file.stat().st_mode & 0o077 == 0
    assert not list(history.glob("users/*/conversations/*.json"))  # nothing refused above wrote anything


def test_two_users_chat_at_once_without_crosstalk(service):
    url, history, _ = service
    prompts = {"alice": "alice: list three kinds of apples", "bob": "bob: describe the colour of the sea"}
    clients = {u: login(url, u) for u in USERS}
    # Reference: each prompt alone (greedy decoding, so the reply is a function of the prompt).
    solo = {}
    for user, client in clients.items():
        conv_id = send(client, prompts[user], max_new_tokens=160)[1]
        solo[user] = HistoryStore(history).user(user).load(conv_id).messages[-1].text
    assert solo["alice"] and solo["bob"] and solo["alice"] != solo["bob"]

    jobs = {u: submit(c, prompts[u], max_new_tokens=160) for u, c in clients.items()}
    peak, deadline = 0, time.monotonic() + 180
    while not all(j.done() for j in jobs.values()) and time.monotonic() < deadline:
        peak = max(peak, health(url)[1].get("active", 0))
        time.sleep(0.05)
    results = {u: j.result(timeout=60) for u, j in jobs.items()}
    assert peak >= 2, "the two replies never streamed at the same time"

    for user, other in (("alice", "bob"), ("bob", "alice")):
        conv_id = results[user][1]
        mine = HistoryStore(history).user(user)
        conv = mine.load(conv_id)
        assert [m.text for m in conv.messages] == [prompts[user], solo[user]]
        assert conv.messages[-1].status in ("complete", "length")
        assert len(mine.list()) == 2 and conv_id not in [s.id for s in HistoryStore(history).user(other).list()]
        streamed = str(jobs[user].outputs())
        assert prompts[other] not in streamed
        listed = clients[user].predict("", api_name="/conversations")["choices"]
        assert {c[1] for c in listed} == {s.id for s in mine.list()}


def test_other_users_conversation_cannot_be_touched(service, tmp_path):
    url, history, _ = service
    alice, bob = login(url, "alice"), login(url, "bob")
    a_id = send(alice, "alice's private note about chelsea", files=[FIXTURES / "chelsea.png"])[1]
    a_file = history / "users" / "alice" / "conversations" / f"{a_id}.json"
    a_image = next((history / "users" / "alice" / "images").glob("*.png"))
    before = digest(a_file)
    bob_before = {s.id for s in HistoryStore(history).user("bob").list()}

    guessed = secrets.token_hex(16)
    targets = [a_id, guessed, f"../alice/conversations/{a_id}", f"../../users/alice/conversations/{a_id}.json",
               str(a_file), f"alice/{a_id}", f"{a_id}/../{a_id}"]
    for target in targets:
        listed, notice = bob.predict(target, "stolen", api_name="/rename")
        assert notice == "conversation not found", (target, notice)
        path, notice = bob.predict(target, api_name="/export")
        assert path is None and notice == "conversation not found", (target, notice)
        *_, notice = bob.predict(target, api_name="/delete")
        assert notice == "conversation not found", (target, notice)
        chat, conv_id, notice, *_ = send(bob, "append this to her chat", conv_id=target)
        assert (chat, conv_id, notice) == ([], "", "conversation not found"), target
        with pytest.raises(AppError):  # the sidebar only offers bob's own conversations
            bob.predict(target, api_name="/open")
    assert "alice" not in str(bob.predict("", api_name="/conversations"))

    # Gradio's file route does not serve history files or images to anyone (history is never an allowed path).
    s = http_session(url, "bob")
    for path in (a_file, a_image, history / "users" / "bob"):
        r = s.get(f"/gradio_api/file={path}")
        assert r.status_code in (403, 404), (path, r.status_code)
        assert b"chelsea" not in r.content

    assert digest(a_file) == before
    assert {s.id for s in HistoryStore(history).user("bob").list()} == bob_before
    # ... while alice herself can do all of it (the refusals above are about ownership, not broken routes)
    assert alice.predict(a_id, "Chelsea the cat", api_name="/rename")[1] == "Renamed to: Chelsea the cat"
    path, notice = alice.predict(a_id, api_name="/export")
    assert notice == "" and Path(path).stat().st_size > a_image.stat().st_size
    assert HistoryStore(history).user("alice").load(a_id).title == "Chelsea the cat"


def test_upload_count_and_size_limits_give_clear_messages(service, tmp_path):
    url, history, _ = service
    alice = login(url, "alice")
    n_before = len(history_files(history))
    three = [FIXTURES / "chelsea.png", FIXTURES / "coffee.png", FIXTURES / "rocket.jpg"]
    chat, conv_id, notice, *_ = send(alice, "compare these", files=three)
    assert notice == f"at most {MAX_IMAGES} images per message, got 3"
    assert (chat, conv_id) == ([], "")

    big = tmp_path / "noise.png"  # random pixels do not compress: ~1.5 MB
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (700, 700, 3), dtype=np.uint8)).save(big)
    limit = MAX_UPLOAD_MB * 1024 * 1024
    assert big.stat().st_size > limit
    with pytest.raises(ValueError, match=f"exceeds the maximum file size of {limit} bytes"):
        send(alice, "what is this?", files=[big])  # gradio_client checks the server's limit before uploading
    r = http_session(url, "alice").post("/gradio_api/upload", files={"files": ("noise.png", big.read_bytes(),
                                                                               "image/png")})
    assert r.status_code == 413 and f"maximum allowed size of {limit} bytes" in r.text
    assert len(history_files(history)) == n_before  # nothing saved for the refused turns

    # within the limits the same session works normally
    chat, conv_id, notice, *_ = send(alice, "and this one?", files=[FIXTURES / "chelsea.png"])
    assert conv_id and notice == ""
    assert len(HistoryStore(history).user("alice").load(conv_id).messages[0].images) == 1
