"""Tests for the conversation store: crash safety, merging with a stale page, concurrency, users and ids.

All on the local file system under pytest's tmp_path; the multi-process test starts 4 short-lived
processes (spawn), a few seconds in all.
"""
from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest

from qwen_chat.chat_types import InvalidImage, InvalidInput
from qwen_chat.history import conversation_files, image_folder
from qwen_chat.history.store import (
    ConversationNotFound,
    HistoryStore,
    HistoryUnavailable,
    MessageNotFound,
    MessageRef,
    StoredMessage,
)

IMAGES = Path(__file__).parents[1] / "fixtures" / "images"


@pytest.fixture
def store(tmp_path) -> HistoryStore:
    return HistoryStore(tmp_path / "history")


def conv_file(history, conv_id: str) -> Path:
    return history.folder / "conversations" / f"{conv_id}.json"


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- basics, reload, titles ---------------------------------------------------------------------------

def test_conversation_survives_a_fresh_store(tmp_path):
    history = HistoryStore(tmp_path / "h").user("local")
    conv = history.create(settings={"temperature": 0.7, "system_prompt": "Be brief."})
    history.append_message(conv.id, role="user", text="What is 1+1?")
    history.append_message(conv.id, role="assistant", text="2", reasoning="1+1 is 2.")

    reopened = HistoryStore(tmp_path / "h").user("local")  # as after a service restart
    loaded = reopened.load(conv.id)
    assert [(m.role, m.text, m.reasoning) for m in loaded.messages] == [
        ("user", "What is 1+1?", ""), ("assistant", "2", "1+1 is 2.")]
    assert loaded.settings == {"temperature": 0.7, "system_prompt": "Be brief."}
    assert loaded.title == "What is 1+1?"  # set from the first user message
    assert loaded.revision == 3  # create + 2 appends
    [summary] = reopened.list()
    assert (summary.id, summary.title, summary.n_messages) == (conv.id, "What is 1+1?", 2)


def test_list_is_newest_first_and_titles(store):
    history = store.user("local")
    first = history.create()
    second = history.create(title="Named by me")
    history.append_message(second.id, role="user", text="this does not rename it")
    long_text = "  A  very " + "long " * 40 + "question\nsecond line"
    history.append_message(first.id, role="user", text=long_text)
    listed = history.list()
    assert [s.id for s in listed] == [first.id, second.id]  # first was updated last
    assert listed[1].title == "Named by me"
    assert listed[0].title.startswith("A very long long") and listed[0].title.endswith("…")
    assert len(listed[0].title) == 80
    image_only = history.create()
    history.append_message(image_only.id, role="user", text="",
                           images=[history.put_image((IMAGES / "coffee.png").read_bytes())])
    assert history.load(image_only.id).title == "Image"
    code_first = history.create()  # a message that starts with a code block: named after its first words
    history.append_message(code_first.id, role="user", text="```python\nprint('hi')\n```\nWhy does this fail?")
    assert history.load(code_first.id).title == "print('hi')"
    marks = history.create()
    history.append_message(marks.id, role="user", text="???")
    assert history.load(marks.id).title == "???"


def test_list_search_matches_titles_and_message_text(store):
    history = store.user("local")
    cat = history.create()
    history.append_message(cat.id, role="user", text="Tell me about  CATS")
    history.append_message(cat.id, role="assistant", text="They purr; Ünïcode Straße too.")
    dog = history.create(title="Dogs and their owners")
    history.append_message(dog.id, role="user", text="walks")
    assert {s.id for s in history.list("")} == {cat.id, dog.id}
    assert [s.id for s in history.list("about cats")] == [cat.id]  # case-insensitive, whitespace collapsed
    assert [s.id for s in history.list("PURR")] == [cat.id]  # the reply's text counts too
    assert [s.id for s in history.list("strasse")] == [cat.id]  # casefold: ß matches ss
    assert [s.id for s in history.list("owners")] == [dog.id]  # the title counts
    assert history.list("giraffe") == []


def test_rename_and_settings_validation(store):
    history = store.user("local")
    conv = history.create()
    assert history.rename(conv.id, "  Trip\n planning ").title == "Trip planning"
    with pytest.raises(InvalidInput):
        history.rename(conv.id, " \n ")
    with pytest.raises(InvalidInput):
        history.set_settings(conv.id, {"bad": object()})
    with pytest.raises(InvalidInput):
        history.set_settings(conv.id, {"nan": float("nan")})
    assert history.load(conv.id).title == "Trip planning"
    assert history.load(conv.id).settings == {}


# --- Unicode (history reloads byte for byte) ---------------------------------------------------------

UNICODE_SAMPLES = [
    "笑脸 😊 and the name c.ⱯI",
    "prefix \ufffd after",
    "مرحبا بالعالم שלום 👨\u200d👩\u200d👧 ab\u200dcd",
    "\u0301 lone combining mark, e\u0301 vs é, \u20dd",
    "tab\tnewline\nnull\x00 and \U0001F9D1\u200D\U0001F680 and $5 <b>not html</b>",
]


def test_unicode_round_trip_byte_for_byte(tmp_path):
    history = HistoryStore(tmp_path).user("local")
    conv = history.create()
    for text in UNICODE_SAMPLES:
        history.append_message(conv.id, role="assistant", text=text, reasoning=text[::-1])
    raw = conv_file(history, conv.id).read_bytes()
    assert "笑脸".encode("utf-8") in raw and b"\\u7b11" not in raw  # real UTF-8, no escapes
    loaded = HistoryStore(tmp_path).user("local").load(conv.id)
    for message, text in zip(loaded.messages, UNICODE_SAMPLES):
        assert message.text.encode("utf-8") == text.encode("utf-8")
        assert message.reasoning == text[::-1]


def test_lone_surrogate_is_refused_and_nothing_saved(store):
    history = store.user("local")
    conv = history.create()
    with pytest.raises(InvalidInput):
        history.append_message(conv.id, role="user", text="bad \ud800 text")
    assert history.load(conv.id).messages == []


# --- crash safety -------------------------------------------------------------------------------------

def test_failed_replace_leaves_old_file_and_no_temp_files(store, monkeypatch):
    history = store.user("local")
    conv = history.create()
    history.append_message(conv.id, role="user", text="kept")
    before = conv_file(history, conv.id).read_bytes()

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(HistoryUnavailable, match="the disk holding the history folder is full"):
        history.append_message(conv.id, role="assistant", text="lost")
    monkeypatch.undo()

    assert conv_file(history, conv.id).read_bytes() == before
    assert files_in(history.folder / "conversations") == [f"{conv.id}.json"]
    assert [m.text for m in history.load(conv.id).messages] == ["kept"]
    assert history.append_message(conv.id, role="assistant", text="next works") == 1


def test_leftover_temp_file_of_a_killed_writer_is_ignored_and_cleaned(store):
    history = store.user("local")
    conv = history.create()
    folder = history.folder / "conversations"
    leftover = folder / f".{conv.id}.json.abc123.tmp"
    leftover.write_text('{"schema_version": 1, "id": "')  # what kill -9 mid-write leaves behind
    assert [s.id for s in history.list()] == [conv.id]
    assert leftover.exists()  # young: could belong to a writer that is still running
    old = time.time() - 2 * conversation_files.STALE_TEMP_S
    os.utime(leftover, (old, old))
    history.list()
    assert not leftover.exists()


def test_corrupt_empty_and_half_written_files_are_set_aside(store, caplog):
    history = store.user("local")
    good = history.create()
    history.append_message(good.id, role="user", text="still here")
    folder = history.folder / "conversations"
    full = conv_file(history, good.id).read_bytes()
    bad_ids = {"0" * 32: b"", "1" * 32: full[: len(full) // 2], "2" * 32: b"\xff\xfe garbage",
               "3" * 32: b'{"schema_version": 1, "id": "' + b"3" * 32 + b'", "messages": "nope"}',
               "4" * 32: b"[1, 2, 3]"}
    for conv_id, data in bad_ids.items():
        (folder / f"{conv_id}.json").write_bytes(data)

    with caplog.at_level(logging.WARNING, logger="qwen_chat.history"):
        listed = history.list()
    assert [s.id for s in listed] == [good.id]
    assert files_in(folder) == [f"{good.id}.json"]
    corrupt = files_in(history.folder / "corrupt")
    assert len(corrupt) == len(bad_ids)
    assert all(any(name.startswith(f"{cid}.json.") for name in corrupt) for cid in bad_ids)
    assert sum("unreadable" in r.getMessage() for r in caplog.records) == len(bad_ids)
    # The bytes are kept (moved, not deleted) for a person to inspect.
    half = next(p for p in (history.folder / "corrupt").iterdir() if p.name.startswith("1" * 32))
    assert half.read_bytes() == full[: len(full) // 2]
    assert [m.text for m in history.load(good.id).messages] == ["still here"]


def test_loading_a_corrupt_file_reports_not_found(store):
    history = store.user("local")
    conv_id = "a" * 32
    (history.folder / "conversations" / f"{conv_id}.json").write_bytes(b'{"schema_version": 1, "id"')
    with pytest.raises(ConversationNotFound):
        history.load(conv_id)
    assert len(files_in(history.folder / "corrupt")) == 1


def test_file_of_a_newer_schema_is_left_alone(store):
    history = store.user("local")
    conv_id = "b" * 32
    path = history.folder / "conversations" / f"{conv_id}.json"
    path.write_text(json.dumps({"schema_version": 3, "id": conv_id}))
    assert history.list() == []
    with pytest.raises(InvalidInput, match="newer version"):
        history.load(conv_id)
    assert path.exists()


def test_reply_streaming_when_the_process_died_reads_as_interrupted(store, monkeypatch):
    history = store.user("local")
    conv = history.create()
    history.append_message(conv.id, role="user", text="Write a long story")
    ref = history.append_message(conv.id, role="assistant", text="", status="streaming")
    history.update_message(conv.id, ref, text="Once upon a", reasoning="plan", status="streaming")
    assert history.load(conv.id).messages[1].status == "streaming"  # this process is still writing it

    monkeypatch.setattr(conversation_files, "_BOOT", "restarted")  # a new service process after kill -9
    loaded = history.load(conv.id)
    assert (loaded.messages[1].status, loaded.messages[1].text) == ("interrupted", "Once upon a")
    assert json.loads(conv_file(history, conv.id).read_text())["messages"][1]["status"] == "streaming"
    history.append_message(conv.id, role="user", text="next turn")  # the next write stores the fix
    on_disk = json.loads(conv_file(history, conv.id).read_text())
    assert [m["status"] for m in on_disk["messages"]] == ["complete", "interrupted", "complete"]


def _stream_forever(root: str, conv_id: str) -> None:
    """Save a growing reply as the web layer does while streaming, until killed."""
    history = HistoryStore(Path(root)).user("local")
    ref = history.append_message(conv_id, role="assistant", text="", status="streaming")
    text = ""
    while True:
        text += "token 笑 "
        history.update_message(conv_id, ref, text=text, status="streaming")


def test_kill_9_while_a_reply_streams_leaves_a_valid_file(tmp_path):
    root = tmp_path / "h"
    history = HistoryStore(root).user("local")
    conv = history.create()
    history.append_message(conv.id, role="user", text="Write a 5000-word story")
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(target=_stream_forever, args=(str(root), conv.id))
    writer.start()
    try:
        deadline = time.monotonic() + 60
        while history.load(conv.id).revision < 30:  # poll until the child has saved many times
            assert writer.is_alive() and time.monotonic() < deadline
        os.kill(writer.pid, 9)
    finally:
        writer.join(timeout=30)
    assert writer.exitcode == -9
    loaded = HistoryStore(root).user("local").load(conv.id)  # parses: old or new version, never partial
    reply = loaded.messages[1]
    assert reply.status == "interrupted"  # its writer process is gone
    assert reply.text.startswith("token 笑 token 笑 ") and reply.text.endswith("token 笑 ")
    assert history.list()[0].n_messages == 2
    # kill -9 between mkstemp and os.replace may leave one temp file (never listed, removed when stale).
    names = files_in(history.folder / "conversations")
    assert [n for n in names if not n.endswith(".tmp")] == [f"{conv.id}.json"]
    assert len(names) <= 2


# --- merge semantics (stale page) and message addressing -----------------------------------------------------

def test_stale_page_append_merges_with_newer_history(tmp_path):
    history = HistoryStore(tmp_path).user("local")
    conv = history.create()
    for i in range(3):
        history.append_message(conv.id, role="user", text=f"q{i}")
        history.append_message(conv.id, role="assistant", text=f"a{i}")
    stale_view = history.load(conv.id)  # a tab that was open before the restart
    restarted = HistoryStore(tmp_path).user("local")
    restarted.append_message(conv.id, role="user", text="from another tab")
    index = history.append_message(conv.id, role="user", text="from the stale tab")
    assert index == 7 and len(stale_view.messages) == 6
    texts = [m.text for m in restarted.load(conv.id).messages]
    assert texts == ["q0", "a0", "q1", "a1", "q2", "a2", "from another tab", "from the stale tab"]


def test_message_ref_follows_the_message_when_others_change(store):
    history = store.user("local")
    conv = history.create()
    history.append_message(conv.id, role="user", text="question")
    ref = history.append_message(conv.id, role="assistant", text="", status="streaming")
    assert isinstance(ref, MessageRef) and ref == 1 and len(ref.message_id) == 16
    # Another tab regenerates: truncates from index 1 and starts its own reply there.
    history.truncate_from(conv.id, 1)
    other = history.append_message(conv.id, role="assistant", text="", status="streaming")
    assert other == 1
    with pytest.raises(MessageNotFound):
        history.update_message(conv.id, ref, text="first tab's text", status="complete")
    saved = history.update_message(conv.id, other, text="second tab's text", status="complete")
    assert [(m.text, m.status) for m in saved.messages] == [("question", "complete"),
                                                           ("second tab's text", "complete")]


def test_update_message_by_id_index_and_validation(store):
    history = store.user("local")
    conv = history.create()
    ref = history.append_message(conv.id, role="assistant", text="")
    history.update_message(conv.id, ref.message_id, text="by id")
    history.update_message(conv.id, 0, reasoning="by index", status="length", notice="token limit")
    message = history.load(conv.id).messages[0]
    assert (message.text, message.reasoning, message.status, message.notice) == (
        "by id", "by index", "length", "token limit")
    with pytest.raises(InvalidInput):
        history.update_message(conv.id, 0, status="finished")
    with pytest.raises(MessageNotFound):
        history.update_message(conv.id, 5, text="x")
    with pytest.raises(MessageNotFound):
        history.update_message(conv.id, "deadbeef", text="x")


def test_truncate_from(store):
    history = store.user("local")
    conv = history.create()
    refs = [history.append_message(conv.id, role=r, text=t)
            for r, t in [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]]
    history.append_message(conv.id, role="user", text="q3 from another tab")
    assert len(history.load(conv.id).messages) == 5
    saved = history.truncate_from(conv.id, refs[3])
    assert [m.text for m in saved.messages] == ["q1", "a1", "q2"]
    saved = history.truncate_from(conv.id, refs[1].message_id)
    assert [m.text for m in saved.messages] == ["q1"]


def test_truncate_with_a_replacement_is_one_change_and_the_made_title_follows(store):
    history = store.user("local")
    conv = history.create()
    image = history.put_image((IMAGES / "coffee.png").read_bytes())
    refs = [history.append_message(conv.id, role=r, text=t, images=[image] if r == "user" else [])
            for r, t in [("user", "first question"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]]
    before = history.load(conv.id).revision
    edited = StoredMessage.new("user", "first question, edited", images=[image])
    saved = history.truncate_from(conv.id, refs[0], replacement=edited)
    assert [(m.text, m.images) for m in saved.messages] == [("first question, edited", [image])]
    assert saved.title == "first question, edited" and saved.revision == before + 1
    history.append_message(conv.id, role="assistant", text="a1")
    again = history.truncate_from(conv.id, saved.messages[0].id, replacement=StoredMessage.new("user", "x"))
    assert again.title == "x"
    history.rename(conv.id, "My own title")
    history.append_message(conv.id, role="assistant", text="a")
    kept = history.truncate_from(conv.id, 0, replacement=StoredMessage.new("user", "y"))
    assert kept.title == "My own title"  # a title the user chose stays
    with pytest.raises(InvalidInput, match="not stored"):
        history.truncate_from(conv.id, 0, replacement=StoredMessage.new("user", "z", images=["0" * 64 + ".png"]))
    assert [m.text for m in history.load(conv.id).messages] == ["y"]


def test_retried_append_of_the_same_message_is_not_duplicated(store):
    history = store.user("local")
    conv = history.create()
    message = StoredMessage.new("user", "once")
    assert history.append_message(conv.id, message) == 0
    revision = history.load(conv.id).revision
    assert history.append_message(conv.id, message) == 0
    loaded = history.load(conv.id)
    assert [m.text for m in loaded.messages] == ["once"] and loaded.revision == revision
    clash = StoredMessage(id=message.id, role="user", text="different")
    with pytest.raises(InvalidInput):
        history.append_message(conv.id, clash)


def test_bad_message_fields_are_refused(store):
    history = store.user("local")
    conv = history.create()
    with pytest.raises(InvalidInput):
        history.append_message(conv.id, role="tool", text="x")
    with pytest.raises(InvalidInput):
        history.append_message(conv.id, role="user", text="x", status="done")
    with pytest.raises(InvalidInput):
        history.append_message(conv.id, role="user", text="x", images=["../../etc/passwd"])
    with pytest.raises(InvalidInput):
        history.append_message(conv.id, role="user", text="x", images=["f" * 64 + ".png"])  # never stored
    assert history.load(conv.id).messages == []


# --- concurrency (200 concurrent saves) ----------------------------------------------------------------

def _append_worker(root: str, conv_id: str, prefix: str, count: int) -> None:
    history = HistoryStore(Path(root)).user("local")
    for i in range(count):
        history.append_message(conv_id, role="user", text=f"{prefix}-{i}")


def test_200_concurrent_saves_from_threads_and_processes(tmp_path):
    root = tmp_path / "h"
    history = HistoryStore(root).user("local")
    conv = history.create()
    path = conv_file(history, conv.id)
    stop = threading.Event()
    bad_reads: list[str] = []

    def reader() -> None:  # every read during the storm sees a complete, valid file
        while not stop.is_set():
            try:
                json.loads(path.read_bytes().decode("utf-8"))
                history.list()
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                bad_reads.append(repr(e))

    ctx = multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=_append_worker, args=(str(root), conv.id, f"p{n}", 20)) for n in range(4)]
    threads = [threading.Thread(target=_append_worker, args=(str(root), conv.id, f"t{n}", 12))
               for n in range(10)]
    read_thread = threading.Thread(target=reader)
    read_thread.start()
    for p in processes:
        p.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in processes:
        p.join(timeout=120)
    stop.set()
    read_thread.join()

    assert [p.exitcode for p in processes] == [0] * 4
    assert bad_reads == []
    loaded = history.load(conv.id)
    texts = [m.text for m in loaded.messages]
    expected = {f"p{n}-{i}" for n in range(4) for i in range(20)} | {f"t{n}-{i}" for n in range(10)
                                                                      for i in range(12)}
    assert len(texts) == 200 and set(texts) == expected
    assert loaded.revision == 201
    for n in range(4):  # each writer's own messages stay in its order
        mine = [t for t in texts if t.startswith(f"p{n}-")]
        assert mine == [f"p{n}-{i}" for i in range(20)]
    assert files_in(path.parent) == [path.name]  # no temp files left


# --- users and ids -----------------------------------------------------------------------------------

def test_users_cannot_reach_each_others_conversations(store):
    alice, bob = store.user("alice"), store.user("bob")
    conv = alice.create()
    alice.append_message(conv.id, role="user", text="alice's secret")
    before = conv_file(alice, conv.id).read_bytes()
    attempts = [
        lambda: bob.load(conv.id),
        lambda: bob.rename(conv.id, "pwned"),
        lambda: bob.delete(conv.id),
        lambda: bob.export_zip(conv.id),
        lambda: bob.append_message(conv.id, role="user", text="hi"),
        lambda: bob.update_message(conv.id, 0, text="changed"),
        lambda: bob.truncate_from(conv.id, 0),
        lambda: bob.set_settings(conv.id, {}),
    ]
    for attempt in attempts:
        with pytest.raises(ConversationNotFound) as info:
            attempt()
        assert str(info.value) == "conversation not found"
    assert bob.list() == []
    assert conv_file(alice, conv.id).read_bytes() == before


@pytest.mark.parametrize("bad_id", [
    "../alice/conversations/" + "a" * 32, "../../users/alice/conversations/x", "/etc/passwd", "a" * 32 + ".json",
    "A" * 32, "a" * 31, "a" * 33, "", "..", "a" * 31 + "\n", None, 12345,
])
def test_malformed_conversation_ids_are_not_found(store, bad_id):
    history = store.user("local")
    with pytest.raises(ConversationNotFound):
        history.load(bad_id)
    with pytest.raises(ConversationNotFound):
        history.delete(bad_id)


def test_guessed_id_is_not_found(store):
    history = store.user("local")
    history.create()
    with pytest.raises(ConversationNotFound):
        history.load("0123456789abcdef0123456789abcdef")


@pytest.mark.parametrize("bad_user", ["", ".", "..", "../alice", "a/b", "a" * 65, "al ice", "ålice", None])
def test_bad_user_ids_are_refused(store, bad_user):
    with pytest.raises(InvalidInput):
        store.user(bad_user)


def test_user_folders_are_separate(store):
    store.user("alice").create()
    store.user("local").create()
    assert sorted(p.name for p in (store.root / "users").iterdir()) == ["alice", "local"]
    assert len(store.user("alice").list()) == 1 and len(store.user("local").list()) == 1


# --- images and export --------------------------------------------------------------------------------

def test_images_are_stored_once_by_content_hash(store):
    import hashlib

    history = store.user("local")
    data = (IMAGES / "chelsea.png").read_bytes()
    name = history.put_image(data)
    assert name == hashlib.sha256(data).hexdigest() + ".png"
    assert history.put_image(data) == name
    assert files_in(history.folder / "images") == [name]
    assert history.image_path(name).read_bytes() == data
    with pytest.raises(InvalidImage):
        history.put_image(b"GIF89a not a png")
    with pytest.raises(InvalidInput):
        history.image_path("../" + name)
    with pytest.raises(InvalidInput):
        store.user("bob").image_path(name)  # another user's image is not reachable


def test_export_zip_holds_the_json_and_its_images(store):
    history = store.user("local")
    conv = history.create()
    png_a = (IMAGES / "chelsea.png").read_bytes()
    png_b = (IMAGES / "coffee.png").read_bytes()
    a, b = history.put_image(png_a), history.put_image(png_b)
    history.append_message(conv.id, role="user", text="two photos 📷", images=[a, b])
    history.append_message(conv.id, role="user", text="the first again", images=[a])
    with zipfile.ZipFile(io.BytesIO(history.export_zip(conv.id))) as zf:
        assert sorted(zf.namelist()) == sorted(["conversation.json", f"images/{a}", f"images/{b}"])
        exported = json.loads(zf.read("conversation.json").decode("utf-8"))
        assert zf.read(f"images/{a}") == png_a and zf.read(f"images/{b}") == png_b
    assert exported == history.load(conv.id).to_dict()
    assert exported["messages"][0]["text"] == "two photos 📷"


def test_delete_removes_the_conversation_and_images_only_it_used(store):
    history = store.user("local")
    keep, drop = history.create(), history.create()
    shared = history.put_image((IMAGES / "chelsea.png").read_bytes())
    only_dropped = history.put_image((IMAGES / "coffee.png").read_bytes())
    history.append_message(keep.id, role="user", text="k", images=[shared])
    history.append_message(drop.id, role="user", text="d", images=[shared, only_dropped])
    old = time.time() - 2 * image_folder.IMAGE_GC_GRACE_S
    for name in (shared, only_dropped):
        os.utime(history.folder / "images" / name, (old, old))
    history.delete(drop.id)
    assert [s.id for s in history.list()] == [keep.id]
    with pytest.raises(ConversationNotFound):
        history.load(drop.id)
    with pytest.raises(ConversationNotFound):
        history.delete(drop.id)
    assert files_in(history.folder / "images") == [shared]
