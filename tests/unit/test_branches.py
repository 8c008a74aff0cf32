"""Kept versions (branches), pins and tags in the history files, and per-user presets.

Old files (schema version 1, no branches) open unchanged and are written back as version 1; Edit and
Regenerate keep the earlier versions; switching shows another version with the turns that followed it; a fork
copies the visible path; 200 concurrent branch edits by two users lose nothing and never cross users; presets
are per user.
"""
from __future__ import annotations

import json
import threading
import zipfile
import io

import pytest

from qwen_chat.chat_types import GenerationSettings, InvalidInput
from qwen_chat.history import branches
from qwen_chat.history.errors import MessageNotFound
from qwen_chat.history.presets import Preset, Presets
from qwen_chat.history.records import StoredMessage
from qwen_chat.history.store import HistoryStore

OLD_FILE = {  # a conversation as the service saved it before kept versions existed
    "schema_version": 1, "id": "a" * 32, "title": "What is 1+1?", "created": "2026-11-30T10:00:00.000000+00:00",
    "updated": "2026-11-30T10:00:05.000000+00:00", "revision": 4,
    "settings": {"system_prompt": "Be brief.", "temperature": 0.7},
    "messages": [
        {"id": "1111111111111111", "role": "user", "text": "What is 1+1?", "reasoning": "", "images": [],
         "status": "complete", "notice": "", "created": "2026-11-30T10:00:00.000000+00:00"},
        {"id": "2222222222222222", "role": "assistant", "text": "2", "reasoning": "1+1 is 2.", "images": [],
         "status": "complete", "notice": "", "created": "2026-11-30T10:00:01.000000+00:00"}],
}


@pytest.fixture
def history(tmp_path):
    return HistoryStore(tmp_path / "history").user("local")


def texts(messages) -> list[str]:
    return [m.text for m in messages]


def chat(history, *turns: str) -> str:
    conv = history.create()
    for i, text in enumerate(turns):
        history.append_message(conv.id, role="user" if i % 2 == 0 else "assistant", text=text)
    return conv.id


def test_an_old_file_opens_unchanged_and_is_written_back_as_version_1(history):
    path = history.folder / "conversations" / f"{'a' * 32}.json"
    path.write_text(json.dumps(OLD_FILE, indent=1))
    conv = history.load("a" * 32)
    assert texts(conv.messages) == ["What is 1+1?", "2"] and conv.branches == [] and not conv.pinned
    assert conv.to_dict() == OLD_FILE  # nothing added, nothing lost
    assert branches.version_table(conv) == []
    history.rename("a" * 32, "Sums")
    saved = json.loads(path.read_text())
    assert saved["schema_version"] == 1 and "branches" not in saved and saved["messages"] == OLD_FILE["messages"]


def test_edit_twice_and_regenerate_once_then_switch_among_the_versions(history):
    conv_id = chat(history, "q1", "a1", "q2", "a2")
    first_q2 = history.load(conv_id).messages[2].id
    # edit q2 twice (each time a new reply follows), then regenerate the last reply once
    branches.keep_and_replace(history, conv_id, first_q2, StoredMessage.new("user", "q2 edited"))
    history.append_message(conv_id, role="assistant", text="a2 for edited")
    second_q2 = history.load(conv_id).messages[2].id
    branches.keep_and_replace(history, conv_id, second_q2, StoredMessage.new("user", "q2 again"))
    history.append_message(conv_id, role="assistant", text="a2 for again")
    last_reply = history.load(conv_id).messages[3].id
    branches.keep_and_replace(history, conv_id, last_reply)
    history.append_message(conv_id, role="assistant", text="a2 regenerated")

    conv = history.load(conv_id)
    assert texts(conv.messages) == ["q1", "a1", "q2 again", "a2 regenerated"]
    assert branches.version_table(conv) == [branches.Versions(2, 3, 3), branches.Versions(3, 2, 2)]

    conv = branches.switch_version(history, conv_id, conv.messages[3].id, -1)  # the reply before Regenerate
    assert texts(conv.messages) == ["q1", "a1", "q2 again", "a2 for again"]
    conv = branches.switch_version(history, conv_id, conv.messages[2].id, -2)  # the first q2: its reply follows
    assert texts(conv.messages) == ["q1", "a1", "q2", "a2"]
    assert branches.version_table(conv) == [branches.Versions(2, 1, 3)]
    conv = branches.switch_version(history, conv_id, conv.messages[2].id, 2)  # back: the reply last shown there
    assert texts(conv.messages) == ["q1", "a1", "q2 again", "a2 for again"]
    with pytest.raises(InvalidInput, match="no other version"):
        branches.switch_version(history, conv_id, conv.messages[2].id, 1)

    reopened = HistoryStore(history.folder.parents[1]).user("local").load(conv_id)  # as after a restart
    assert texts(reopened.messages) == texts(conv.messages)
    # the list's search finds text that is only in an earlier version ("a2 regenerated" is not shown now)
    assert [s.id for s in history.list("A2 REGENERATED")] == [conv_id] and history.list("a2 never") == []
    assert sorted(texts(reopened.every_message())) == sorted(
        ["q1", "a1", "q2", "a2", "q2 edited", "a2 for edited", "q2 again", "a2 for again", "a2 regenerated"])
    saved = json.loads((history.folder / "conversations" / f"{conv_id}.json").read_text())
    assert saved["schema_version"] == 2 and len(saved["branches"]) == 5


def test_a_title_made_from_the_first_message_follows_the_version_shown(history):
    conv_id = chat(history, "Tell me about owls", "Owls are birds.")
    first = history.load(conv_id).messages[0]
    branches.keep_and_replace(history, conv_id, first.id, StoredMessage.new("user", "Tell me about cats"))
    assert history.load(conv_id).title == "Tell me about cats"  # the edit is shown
    conv = branches.switch_version(history, conv_id, history.load(conv_id).messages[0].id, -1)
    assert conv.title == "Tell me about owls"  # back to the first version: its title
    history.rename(conv_id, "Animals")  # a title the user chose stays whatever is shown
    conv = branches.switch_version(history, conv_id, history.load(conv_id).messages[0].id, 1)
    assert conv.title == "Animals"


def test_export_holds_the_kept_versions_and_their_images(history, tmp_path):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, format="PNG")
    image = history.put_image(buffer.getvalue())
    conv = history.create()
    history.append_message(conv.id, role="user", text="look", images=[image])
    history.append_message(conv.id, role="assistant", text="red")
    branches.keep_and_replace(history, conv.id, history.load(conv.id).messages[0].id,
                              StoredMessage.new("user", "no image now"))
    with zipfile.ZipFile(io.BytesIO(history.export_zip(conv.id))) as zf:
        data = json.loads(zf.read("conversation.json"))
        assert [h["message"]["text"] for h in data["branches"]] == ["look", "red"]
        assert zf.namelist() == ["conversation.json", f"images/{image}"]
    other = history.create()
    history.append_message(other.id, role="user", text="x")
    history.delete(other.id)  # deleting another conversation keeps the images kept versions use
    assert history.image_path(image).exists()


def test_a_reply_switched_away_while_it_streams_is_still_saved(history):
    conv_id = chat(history, "q1", "a1")
    conv = history.load(conv_id)
    branches.keep_and_replace(history, conv_id, conv.messages[1].id)
    ref = history.append_message(conv_id, role="assistant", text="", status="streaming")
    branches.switch_version(history, conv_id, ref.message_id, -1)
    history.update_message(conv_id, ref, text="the whole reply", status="complete")
    conv = history.load(conv_id)
    assert texts(conv.messages) == ["q1", "a1"]
    assert [(h.message.text, h.message.status) for h in conv.branches] == [("the whole reply", "complete")]


def test_fork_copies_the_visible_path_up_to_a_message(history):
    conv_id = chat(history, "q1", "a1", "q2", "a2")
    conv = history.load(conv_id)
    branches.keep_and_replace(history, conv_id, conv.messages[3].id)
    history.append_message(conv_id, role="assistant", text="a2 again")
    conv = history.load(conv_id)
    forked = branches.fork(history, conv_id, conv.messages[1].id)
    assert forked.id != conv_id and texts(forked.messages) == ["q1", "a1"] and forked.branches == []
    assert forked.title == "q1 (fork)"
    assert texts(history.load(conv_id).messages) == ["q1", "a1", "q2", "a2 again"]  # unchanged
    history.append_message(forked.id, role="user", text="q3 in the fork")
    assert texts(history.load(conv_id).messages) == ["q1", "a1", "q2", "a2 again"]


def test_pin_and_tags_do_not_move_the_conversation_in_time(history):
    conv_id = chat(history, "q1")
    before = history.load(conv_id).updated

    def pin(conv):
        conv.pinned, conv.tags = True, ["work"]

    history.mutate(conv_id, pin, touch=False)
    [summary] = history.list()
    assert summary.pinned and summary.tags == ("work",) and summary.updated == before


def test_200_concurrent_branch_edits_across_two_users_lose_nothing(tmp_path):
    store = HistoryStore(tmp_path / "history")
    users = {"alice": store.user("alice"), "bob": store.user("bob")}
    convs = {name: chat(h, f"{name} q", f"{name} a") for name, h in users.items()}
    errors: list[BaseException] = []

    def work(name: str, worker: int) -> None:
        history, conv_id = users[name], convs[name]
        try:
            for i in range(20):
                text = f"{name} edit {worker}-{i}"
                while True:  # an edit of a message another thread replaced meanwhile is refused: edit the new one
                    first = history.load(conv_id).messages[0].id
                    try:
                        branches.keep_and_replace(history, conv_id, first, StoredMessage.new("user", text))
                        break
                    except MessageNotFound:
                        continue
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(name, w)) for name in users for w in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name, history in users.items():
        conv = history.load(convs[name])
        every = texts(conv.every_message())
        edits = [t for t in every if " edit " in t]
        assert len(edits) == 100 and len(set(edits)) == 100  # 5 workers x 20 edits, none lost
        assert all(t.startswith(name) for t in every)  # never another user's
        assert len(branches.versions_at(conv, 0)) == 101  # the original and every edit are versions of turn 1


def test_presets_persist_per_user_and_never_leak(tmp_path):
    store = HistoryStore(tmp_path / "history")
    alice, bob = Presets(store.user("alice")), Presets(store.user("bob"))
    short = Preset.make(" Short  answers ", "Answer in one sentence.",
                        GenerationSettings.preset(True, max_new_tokens=512, thinking_token_budget=128))
    alice.save(short, make_default=True)
    book = Presets(HistoryStore(tmp_path / "history").user("alice")).read()  # as after a restart
    assert book.names() == ["Short answers"] and book.default == "Short answers"
    assert book.get("Short answers").settings().thinking_token_budget == 128
    assert bob.read().names() == [] and bob.read().default is None
    with pytest.raises(InvalidInput, match="no preset"):
        bob.delete("Short answers")
    with pytest.raises(InvalidInput, match="name"):
        Preset.make("  ", "", GenerationSettings())
    with pytest.raises(InvalidInput, match="temperature"):
        Preset.make("hot", "", GenerationSettings(temperature=9.0))
    alice.save(Preset.make("Short answers", "Be terse.", GenerationSettings()))  # replaces in place
    assert alice.read().get("Short answers").system_prompt == "Be terse." and alice.read().default == "Short answers"
    assert alice.delete("Short answers").default is None
    (store.user("bob").folder / "presets.json").write_text("{not json")
    assert bob.read().names() == []  # an unreadable file reads as no presets and is set aside
    assert any(p.name.startswith("presets.json") for p in (store.user("bob").folder / "corrupt").iterdir())
