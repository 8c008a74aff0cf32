"""The whole service as a user starts it: ``python app.py --model tiny`` in a subprocess (real composition root,
real ChatEngine on the built-in tiny model, CPU), driven through the web UI with ``gradio_client``.

Also the composition root's exit codes: 2 for a bad command line, 1 when the model cannot be loaded.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file

from qwen_chat.history.store import HistoryStore
from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[2]
CHELSEA = REPO / "tests" / "fixtures" / "images" / "chelsea.png"
# thinking, max_new_tokens, temperature (0 = greedy), top_p, top_k, presence_penalty, seed
GREEDY_64 = [True, 64, 0.0, 0.95, 20, 1.5, None]


def texts(chat, role):
    return [p["text"] for m in chat if m["role"] == role and not m.get("metadata")
            for p in m["content"] if p["type"] == "text"]


def thoughts(chat):
    return [p["text"] for m in chat if m.get("metadata") for p in m["content"] if p["type"] == "text"]


@pytest.fixture(scope="module")
def app_process(tiny_checkpoint, tmp_path_factory):
    history = tmp_path_factory.mktemp("history")
    port = free_port()
    log_path = tmp_path_factory.mktemp("log") / "app.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "app.py", "--model", "tiny", "--cache-dir", str(tiny_checkpoint.parent),
             "--device", "cpu", "--port", str(port), "--history-dir", str(history), "--max-batch", "2"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 240
        try:
            while True:
                assert proc.poll() is None, f"app.py exited early:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"no /healthz 200 in 240 s:\n{log_path.read_text()[-3000:]}"
                try:
                    if httpx.get(url + "healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield url, HistoryStore(history)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.slow  # starts app.py with the tiny model (~30-60 s on 2 CPU cores)
def test_image_turn_on_tiny_engine_is_saved_and_reopens(app_process):
    url, store = app_process
    client = Client(url, verbose=False)
    question = {"text": "What is in this photo?", "files": [handle_file(str(CHELSEA))]}
    chat, conv_id, notice, _, _ = client.predict(question, "", "", *GREEDY_64, api_name="/send")
    saved = store.user("local").load(conv_id)
    user, reply = saved.messages
    assert user.text == "What is in this photo?" and len(user.images) == 1
    assert reply.role == "assistant" and reply.status in ("complete", "length")
    # random weights: some text was generated, reasoning first because thinking is on
    assert reply.reasoning or reply.text
    assert (thoughts(chat) + texts(chat, "assistant"))[0].strip()
    # greedy decoding is reproducible: Regenerate gives the same reply
    again = client.predict(conv_id, "", *GREEDY_64, api_name="/regenerate")[0]
    regenerated = store.user("local").load(conv_id).messages[-1]
    assert (regenerated.text, regenerated.reasoning) == (reply.text, reply.reasoning)
    assert len(store.user("local").load(conv_id).messages) == 2
    reopened = Client(url, verbose=False)
    reopened.predict("", api_name="/conversations")
    chat = reopened.predict(conv_id, api_name="/open")[0]
    assert sum(p["type"] == "file" for m in chat for p in m["content"]) == 1
    assert thoughts(chat) == thoughts(again)


@pytest.mark.slow  # decodes on the tiny model until stopped
def test_stop_on_tiny_engine_saves_stopped_turn(app_process):
    url, store = app_process
    client = Client(url, verbose=False)
    for seed in (7, 8, 9):  # random weights may sample an end token early; then try another seed
        job = client.submit({"text": "Write a 5000-word story", "files": []}, "", "",
                            True, 8192, 1.0, 0.95, 20, 1.5, seed, api_name="/send")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(o[0] and thoughts(o[0]) for o in job.outputs()):
            time.sleep(0.1)
        conv_id = [o[1] for o in job.outputs() if o[1]][-1]
        client.predict(api_name="/stop")
        deadline = time.monotonic() + 60
        # this process did not write the file, so a reply still streaming in app.py reads as "interrupted"
        while time.monotonic() < deadline and store.user("local").load(conv_id).messages[-1].status in (
                "streaming", "interrupted"):
            time.sleep(0.1)
        reply = store.user("local").load(conv_id).messages[-1]
        if reply.status != "complete":
            break
    assert reply.status == "stopped", (reply.status, reply.notice)
    assert reply.reasoning  # the partial reply is kept
    # the engine is free again: the next request is answered
    client.predict({"text": "hi", "files": []}, conv_id, "", *GREEDY_64, api_name="/send")
    assert store.user("local").load(conv_id).messages[-1].status in ("complete", "length")


def test_bad_command_line_exits_2_with_message():
    out = subprocess.run([sys.executable, "app.py", "--port", "0"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "--port must be 1..65535" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # imports torch/transformers in a subprocess (~10 s)
def test_missing_model_exits_1_naming_the_alternatives(tmp_path):
    out = subprocess.run([sys.executable, "app.py", "--model", str(tmp_path / "no-such-checkpoint"),
                          "--device", "cpu", "--port", str(free_port()), "--history-dir", str(tmp_path / "h")],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("app.py: cannot start the engine")
    assert "--model PATH" in last and "--model tiny" in last
