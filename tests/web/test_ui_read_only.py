"""The chat page (real FastAPI + Gradio, driven with ``gradio_client``; scripted backend) when the history folder
stops being writable mid-reply: the page says so in a short message without server paths, the reply ends
normally, the tab is not left busy, and the next message works once the folder is writable again.  The folder
is made unwritable in Python (``tests.support.read_only``): the tests run as root, for whom ``chmod`` blocks
nothing."""
from __future__ import annotations

import pytest
from gradio_client import Client

from qwen_chat.config import ServiceConfig
from qwen_chat.history.store import HistoryStore
from qwen_chat.history.turns import SAVE_RETRY_S
from qwen_chat.web.server import build_app
from tests.support.fake_backend import FakeBackend
from tests.support.read_only import ReadOnlyFolder
from tests.support.servers import RunningServer
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

# thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, seed
CONTROLS = [False, 2048, 1.0, 0.95, 20, 1.5, None]
ANSWER = " ".join(f"w{i}" for i in range(150))
NOT_WRITABLE = "Could not save the conversation: the history folder is not writable"


def assistant_texts(chat: list[dict]) -> list[str]:
    return [p["text"] for m in chat if m["role"] == "assistant" and not m.get("metadata")
            for p in m["content"] if p["type"] == "text"]


def send(client: Client, text: str, conv_id: str = ""):
    return client.predict({"text": text, "files": []}, conv_id, "", *CONTROLS, api_name="/send")


def test_history_turning_read_only_mid_reply_leaves_the_tab_usable(tmp_path, monkeypatch):
    backend = FakeBackend.for_ui(answer=ANSWER, step_delay_s=0.02)
    store = HistoryStore(tmp_path)
    folder = ReadOnlyFolder(tmp_path, monkeypatch)
    history = store.user("local")
    with RunningServer(build_app(ServiceConfig(port=7860, history_dir=tmp_path), backend, store)) as server:
        client = Client(server.url, verbose=False)
        job = client.submit({"text": "tell me a story", "files": []}, "", "", *CONTROLS, api_name="/send")
        wait_until(lambda: any(m and m[-1].text for m in (history.load(s.id).messages for s in history.list())),
                   timeout_s=30,  # (a new chat is listed a moment before its first message is in it)
                   what="a save of the reply with some text")
        folder.on = True
        chat, conv_id, notice = job.result(timeout=60)[:3]
        assert folder.refused and NOT_WRITABLE in notice
        assert str(tmp_path) not in notice and "Errno" not in notice and ".lock" not in notice
        assert assistant_texts(chat)[-1] == ANSWER  # the whole reply is on the page
        # still read-only: the next message is refused with the same message and handed back to the box
        chat, _, notice, box, _ = send(client, "still there?", conv_id)
        assert NOT_WRITABLE in notice and "still being written" not in notice
        assert (box.get("value", box) if isinstance(box, dict) else box)["text"] == "still there?"
        # the chat drawn again from the history still shows the reply as generated, not its last good save
        assert assistant_texts(chat)[-1] == ANSWER
        assert history.load(conv_id).messages[-1].text != ANSWER
        # writable again: the reply is saved whole, and the next message is answered
        folder.on = False
        wait_until(lambda: history.load(conv_id).messages[-1].status == "complete", timeout_s=10 * SAVE_RETRY_S,
                   what="the reply saved once the folder is writable")
        assert history.load(conv_id).messages[-1].text == ANSWER
        backend.answer = "fine"
        chat, _, notice = send(client, "still there?", conv_id)[:3]
        assert assistant_texts(chat)[-1] == "fine" and notice == ""
        assert [m.role for m in history.load(conv_id).messages] == ["user", "assistant", "user", "assistant"]
