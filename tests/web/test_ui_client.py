"""The web UI launched in-process (real FastAPI + Gradio + history store) and driven with ``gradio_client``.

The backend is ``tests.support.fake_backend.FakeBackend.for_ui()`` (no model); the engine on the tiny model is covered
by ``test_ui_tiny.py``.  Covers: text turn, streamed image turn (chelsea.png), Stop, New chat, reopen,
bad images (text, empty, truncated and SVG files named as images; HEIC, also renamed), every allowed type in
any case (upper-case WEBP), empty messages, HTML/dollar text, a page left open across a restart,
rename/delete/export, a refused message handed back to the input box, a new conversation listed as soon as it
is saved, and two logged-in users.
"""
from __future__ import annotations

import io
import json
import re
import time
import zipfile
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from qwen_chat.config import ServiceConfig
from qwen_chat.history.store import HistoryStore
from qwen_chat.web import auth
from qwen_chat.web.server import build_app
from tests.support.fake_backend import FakeBackend
from tests.support.servers import RunningServer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "images"
CHELSEA = FIXTURES / "chelsea.png"
# thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, seed
CONTROLS = [True, 2048, 1.0, 0.95, 20, 1.5, None]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    backend = FakeBackend.for_ui()
    store = HistoryStore(root)
    cfg = ServiceConfig(port=7860, history_dir=root)
    with RunningServer(build_app(cfg, backend, store)) as server:
        yield server, backend, store


@pytest.fixture
def ui(service):
    """(client, backend, store) with the backend reset to its defaults and a fresh browser session."""
    server, backend, store = service
    defaults = FakeBackend.for_ui()
    for name in ("answer", "reasoning", "step_delay_s", "fail_with", "max_steps", "notice"):
        setattr(backend, name, getattr(defaults, name))
    return Client(server.url, verbose=False), backend, store


def send(client: Client, text: str, files=(), conv_id: str = "", controls=CONTROLS):
    message = {"text": text, "files": [handle_file(str(f)) for f in files]}
    return client.predict(message, conv_id, "", *controls, api_name="/send")


def unchanged(value) -> bool:
    """True for an output the handler skipped (``gr.skip()``): the page keeps what it shows."""
    return value is None or value == {"__type__": "update"}


def texts(chat: list[dict], role: str) -> list[str]:
    return [part["text"] for m in chat if m["role"] == role and not m.get("metadata")
            for part in m["content"] if part["type"] == "text"]


def files(chat: list[dict]) -> list[str]:
    return [part["file"] for m in chat for part in m["content"] if part["type"] == "file"]


def saved(store: HistoryStore, conv_id: str, user: str = "local"):
    return store.user(user).load(conv_id)


def test_text_turn_streams_reply_with_reasoning_and_saves_it(ui):
    client, backend, store = ui
    backend.step_delay_s = 0.02
    chat, conv_id, notice, _, _ = send(client, "hello there")
    assert texts(chat, "user") == ["hello there"]
    assert texts(chat, "assistant") == ["You said: hello there (0 image(s))"]
    thought = [m for m in chat if m.get("metadata")]
    assert thought[0]["metadata"]["title"] == "Thinking"
    assert thought[0]["content"][0]["text"] == "The user wrote something; I will repeat it."
    conv = saved(store, conv_id)
    assert [(m.role, m.text, m.status) for m in conv.messages] == [
        ("user", "hello there", "complete"),
        ("assistant", "You said: hello there (0 image(s))", "complete"),
    ]
    assert conv.messages[1].reasoning == "The user wrote something; I will repeat it."
    assert conv.title == "hello there"
    assert notice == ""


def test_image_turn_is_streamed_and_model_gets_the_image(ui):
    client, backend, store = ui
    backend.step_delay_s = 0.05
    backend.answer = "a cat on a blanket with {images} image(s) and more words to stream slowly"
    job = client.submit({"text": "What is in this photo?", "files": [handle_file(str(CHELSEA))]}, "", "",
                        *CONTROLS, api_name="/send")
    chat, conv_id = job.result(timeout=60)[:2]
    answers = [texts(out[0], "assistant") for out in job.outputs() if out[0]]
    partial = [a[0] for a in answers if a and a[0] != "a cat on a blanket with 1 image(s) and more words to stream slowly"]
    assert partial, "no intermediate (streamed) reply was seen"
    assert texts(chat, "assistant") == ["a cat on a blanket with 1 image(s) and more words to stream slowly"]
    assert len(files(chat)) == 1 and Path(files(chat)[0]).suffix == ".png"
    sent = backend.calls[-1].messages[-1]
    assert sent.text == "What is in this photo?" and len(sent.images) == 1
    with Image.open(sent.images[0]) as im:
        assert im.mode == "RGB" and im.size == Image.open(CHELSEA).size
    assert len(saved(store, conv_id).messages[0].images) == 1


def test_image_only_message_is_answered(ui):
    client, backend, store = ui
    chat, conv_id, *_ = send(client, "", files=[CHELSEA])
    assert texts(chat, "assistant") == ["You said:  (1 image(s))"]
    assert saved(store, conv_id).title == "Image"


@pytest.mark.parametrize("text", ["", "   \n\t", "\u200b", "\u200b \u200d\ufeff"])
def test_empty_message_does_nothing(ui, text):
    client, backend, store = ui
    before_calls, before_convs = len(backend.calls), len(store.user("local").list())
    out = send(client, text)
    assert unchanged(out[0])  # chatbot left unchanged (gr.skip), no bubble
    assert len(backend.calls) == before_calls
    assert len(store.user("local").list()) == before_convs


@pytest.mark.parametrize(
    "name,data,expected",
    [
        ("notes.jpg", b"just some text, not an image", "not a valid image"),
        ("photo.png", b"", "empty"),
        ("half.jpg", None, "not a valid image"),
        ("logo.png", b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>', "allowed"),
    ],
)
def test_bad_image_shows_message_saves_nothing_and_next_turn_works(ui, tmp_path, name, data, expected):
    client, backend, store = ui
    if data is None:  # a real JPEG cut in half (truncated file)
        buf = io.BytesIO()
        Image.open(CHELSEA).convert("RGB").save(buf, "JPEG")
        data = buf.getvalue()[: len(buf.getvalue()) // 2]
    bad = tmp_path / name
    bad.write_bytes(data)
    chat, conv_id, _, _ = send(client, "hello")[:4]
    n_before = len(saved(store, conv_id).messages)
    n_calls = len(backend.calls)
    out_chat, out_id, notice, box, _ = send(client, "look at this", files=[bad], conv_id=conv_id)
    assert expected in notice.lower()
    assert name in notice
    assert out_id == conv_id
    assert texts(out_chat, "user") == ["hello"]  # the page shows what is saved, no failed bubble
    # the refused file leaves the input box, the typed text stays for a retry
    box = box.get("value", box) if isinstance(box, dict) else box  # gradio_client shows the update
    assert box == {"text": "look at this", "files": []}
    assert len(saved(store, conv_id).messages) == n_before
    assert len(backend.calls) == n_calls
    chat, _, notice, _, _ = send(client, "and now text only", conv_id=conv_id)
    assert texts(chat, "assistant")[-1] == "You said: and now text only (0 image(s))"
    assert [m.text for m in saved(store, conv_id).messages if m.role == "user"] == ["hello", "and now text only"]


def test_heic_upload_is_refused_naming_allowed_formats(ui, tmp_path):
    client, backend, store = ui
    heic = tmp_path / "IMG_0001.HEIC"
    heic.write_bytes(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic")
    with pytest.raises(AppError) as err:
        send(client, "what is this?", files=[heic])
    assert ".webp" in str(err.value) and ".jpg" in str(err.value)
    renamed = tmp_path / "IMG_0001.jpg"  # the same bytes with a JPEG name: caught by content sniffing
    renamed.write_bytes(heic.read_bytes())
    n_convs = len(store.user("local").list())
    notice = send(client, "what is this?", files=[renamed])[2]
    assert "allowed: JPEG, PNG, GIF, WEBP" in notice
    assert len(store.user("local").list()) == n_convs


@pytest.mark.parametrize("name,fmt", [("CHELSEA.WEBP", "WEBP"), ("chelsea.webp", "WEBP"), ("Cat.JPG", "JPEG"),
                                      ("anim.GIF", "GIF")])
def test_every_allowed_type_in_any_case_reaches_the_model(ui, tmp_path, name, fmt):
    client, backend, store = ui
    path = tmp_path / name
    with Image.open(CHELSEA) as im:
        if fmt == "GIF":
            frames = [im.convert("RGB").rotate(a) for a in (0, 90, 180)]
            frames[0].save(path, "GIF", save_all=True, append_images=frames[1:])
        else:
            im.convert("RGB").save(path, fmt)
    chat = send(client, "describe", files=[path])[0]
    assert texts(chat, "assistant") == ["You said: describe (1 image(s))"]
    assert len(backend.calls[-1].messages[-1].images) == 1


def test_stop_ends_generation_and_saves_partial_reply_as_stopped(ui):
    client, backend, store = ui
    backend.step_delay_s = 0.05
    backend.answer = " ".join(f"word{i}" for i in range(400))
    job = client.submit({"text": "write a long story", "files": []}, "", "", *CONTROLS, api_name="/send")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(texts(o[0], "assistant") for o in job.outputs() if o[0]):
        time.sleep(0.05)
    conv_id = [o[1] for o in job.outputs() if o[1]][-1]
    client.predict(api_name="/stop")
    call = backend.calls[-1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (call.finish_reason is None or backend.active):
        time.sleep(0.05)
    assert call.finish_reason in ("cancelled", "closed")
    assert call.steps < 300  # stopped long before the 400-word script ran out
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and saved(store, conv_id).messages[-1].status == "streaming":
        time.sleep(0.05)
    reply = saved(store, conv_id).messages[-1]
    assert reply.status == "stopped"
    assert reply.text.startswith("word0")
    reopened = client.predict(conv_id, api_name="/open")[0]
    assert texts(reopened, "assistant")[-1].endswith("*[stopped by the user]*")
    # the queue is free: the next turn in the same conversation is answered normally
    backend.answer, backend.step_delay_s = "ok", 0.0
    assert texts(send(client, "next", conv_id=conv_id)[0], "assistant")[-1] == "ok"


def test_new_conversation_is_listed_as_soon_as_it_is_saved(ui):
    client, backend, store = ui
    backend.step_delay_s = 0.05
    backend.answer = " ".join(f"w{i}" for i in range(40))
    job = client.submit({"text": "listed before the reply ends", "files": []}, "", "", *CONTROLS,
                        api_name="/send")
    job.result(timeout=60)
    outputs = job.outputs()
    first_saved = next(i for i, out in enumerate(outputs) if out[1])
    conv_id = outputs[first_saved][1]
    listed = outputs[first_saved][4]
    assert conv_id in [c[1] for c in listed["choices"]] and listed["value"] == conv_id
    assert first_saved < len(outputs) - 1  # before the end of the reply
    assert not texts(outputs[first_saved][0], "assistant") or "w39" not in texts(outputs[first_saved][0],
                                                                                     "assistant")[-1]


def test_new_chat_and_reopen_from_sidebar(ui):
    client, backend, store = ui
    first = send(client, "first conversation", files=[CHELSEA])
    chat, conv_id, notice, box, listed, title = client.predict(api_name="/new_chat")
    assert chat == [] and conv_id == ""
    second = send(client, "second conversation")
    assert second[1] != first[1]
    ids = [c[1] for c in client.predict("", api_name="/conversations")["choices"]]
    assert ids[:2] == [second[1], first[1]]  # newest first
    chat, opened, _, system_prompt, title = client.predict(first[1], api_name="/open")
    assert opened == first[1] and title == "first conversation"
    assert texts(chat, "user") == ["first conversation"]
    assert len(files(chat)) == 1
    assert texts(chat, "assistant") == ["You said: first conversation (1 image(s))"]


def test_html_and_dollars_stay_literal_text_live_and_after_reload(ui):
    client, backend, store = ui
    backend.answer = "{last_user}"
    attack = "<img src=x onerror=alert(document.domain)> costs $5 and $10 <script>alert(1)</script>"
    chat, conv_id, *_ = send(client, attack)
    escaped = "&lt;img src=x onerror=alert(document.domain)> costs $5 and $10 &lt;script>alert(1)&lt;/script>"
    assert texts(chat, "user") == [escaped]
    assert texts(chat, "assistant") == [escaped]
    assert saved(store, conv_id).messages[0].text == attack  # stored exactly as typed
    reloaded = Client(client.src, verbose=False)  # a session that never listed it (page open across a restart)
    reopened = reloaded.predict(conv_id, api_name="/open")[0]
    assert texts(reopened, "user") == [escaped] and texts(reopened, "assistant") == [escaped]


def test_stale_page_after_restart_appends_to_saved_history(ui, service):
    """A page left open across a restart: the page's state is gone (new session) but its conversation id still appends on disk."""
    client, backend, store = ui
    conv_id = ""
    for i in range(3):
        conv_id = send(client, f"turn {i}", conv_id=conv_id)[1]
    stale_page = Client(service[0].url, verbose=False)  # a session that never saw this conversation
    chat, same_id, *_ = send(stale_page, "after restart", conv_id=conv_id)
    assert same_id == conv_id
    users = [m.text for m in saved(store, conv_id).messages if m.role == "user"]
    assert users == ["turn 0", "turn 1", "turn 2", "after restart"]
    assert texts(chat, "user") == users


def test_regenerate_replaces_last_reply(ui):
    client, backend, store = ui
    chat, conv_id, *_ = send(client, "question")
    backend.answer = "another answer"
    chat = client.predict(conv_id, "", *CONTROLS, api_name="/regenerate")[0]
    assert texts(chat, "assistant") == ["another answer"]
    assert [m.text for m in saved(store, conv_id).messages] == ["question", "another answer"]


def test_thinking_cut_by_token_limit_is_shown_as_unfinished_reasoning(ui):
    client, backend, store = ui
    backend.reasoning = "step one step two step three"
    backend.max_steps = 3
    chat, conv_id, notice, *_ = send(client, "prove it")
    thought = [m for m in chat if m.get("metadata")]
    assert thought[0]["metadata"]["title"] == "Thinking (unfinished)"
    assert thought[0]["content"][0]["text"] == "step one step"
    assert texts(chat, "assistant") == ["*[token limit reached]*"]
    assert "token limit reached while thinking" in notice
    reply = saved(store, conv_id).messages[-1]
    assert (reply.text, reply.reasoning, reply.status) == ("", "step one step", "length")


def test_out_of_range_seed_and_backend_refusal_are_messages(ui):
    client, backend, store = ui
    out = send(client, "hi", controls=[True, 2048, 1.0, 0.95, 20, 1.5, -5])
    assert "seed" in out[2] and unchanged(out[0])
    from qwen_chat.chat_types import ContextTooLong

    backend.fail_with = ContextTooLong("prompt has 5000 tokens; the context holds 4096", 5000, 4096)
    n_convs = len(store.user("local").list())
    chat, conv_id, notice, box, _ = send(client, "very long text", files=[CHELSEA])
    assert "5000 tokens" in notice
    assert chat == [] and conv_id == ""
    box = box.get("value", box) if isinstance(box, dict) else box
    assert box["text"] == "very long text" and len(box["files"]) == 1  # the refused message goes back
    assert len(store.user("local").list()) == n_convs


def test_rename_export_delete(ui):
    client, backend, store = ui
    conv_id = send(client, "to be renamed", files=[CHELSEA])[1]
    listed, notice = client.predict(conv_id, "My cat", api_name="/rename")
    [label] = [c[0] for c in listed["choices"] if c[1] == conv_id]
    assert re.fullmatch(r"My cat · (today|yesterday) \d\d:\d\d", label)  # the title and when it changed
    assert saved(store, conv_id).title == "My cat"
    assert "empty" in client.predict(conv_id, "   ", api_name="/rename")[1]
    path, _ = client.predict(conv_id, api_name="/export")
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        data = json.loads(zf.read("conversation.json"))
    assert data["id"] == conv_id and data["title"] == "My cat"
    assert [n for n in names if n.startswith("images/")] == [f"images/{data['messages'][0]['images'][0]}"]
    chat, cleared_id, listed, title, notice = client.predict(conv_id, api_name="/delete")
    assert chat == [] and cleared_id == ""
    assert conv_id not in [c[1] for c in listed["choices"]]
    assert conv_id not in [s.id for s in store.user("local").list()]


def test_two_logged_in_users_see_only_their_own_history(tmp_path):
    users_file = tmp_path / "users.txt"
    db = auth.UserDB()
    db.set_password("alice", "alice-password-1", rounds=4)
    db.set_password("bob", "bob-password-22", rounds=4)
    db.save(users_file)
    store = HistoryStore(tmp_path / "history")
    cfg = ServiceConfig(history_dir=tmp_path / "history", login=True, users_file=users_file)
    with RunningServer(build_app(cfg, FakeBackend.for_ui(), store)) as server:
        alice = Client(server.url, auth=("alice", "alice-password-1"), verbose=False)
        bob = Client(server.url, auth=("bob", "bob-password-22"), verbose=False)
        a_id = send(alice, "alice's secret")[1]
        b_id = send(bob, "bob's note")[1]
        assert [s.id for s in store.user("alice").list()] == [a_id]
        assert [s.id for s in store.user("bob").list()] == [b_id]
        assert [c[1] for c in bob.predict("", api_name="/conversations")["choices"]] == [b_id]
        for attempt in (lambda: bob.predict(a_id, api_name="/open"),
                        lambda: bob.predict(a_id, "stolen", api_name="/rename"),
                        lambda: bob.predict(a_id, api_name="/export"),
                        lambda: bob.predict(a_id, api_name="/delete")):
            try:
                out = attempt()
            except AppError:
                continue
            assert "alice's secret" not in json.dumps(out)
        # bob's page sending with alice's id: refused, nothing written to alice's conversation
        out = send(bob, "hijack", conv_id=a_id)
        assert "not found" in out[2]
        assert [m.text for m in store.user("alice").load(a_id).messages] == [
            "alice's secret", "You said: alice's secret (0 image(s))"]
        assert store.user("alice").load(a_id).title == "alice's secret"
        with pytest.raises(Exception):
            Client(server.url, auth=("alice", "wrong-password"), verbose=False)
