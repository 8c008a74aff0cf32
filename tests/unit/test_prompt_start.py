"""The front starts its prompt workers early (``EngineHub.start_prompts``: with ``--model`` a checkpoint on this
machine already, ``folders.cached_checkpoint``, beside the engine's loading) and the engine's hello keeps them
when it loaded that folder, or starts them again on the folder it names."""
from __future__ import annotations

import socket

import pytest

from qwen_chat.engine.checkpoints import folders
from qwen_chat.engine.client import engine_hub
from qwen_chat.engine.text import prompt_worker
from qwen_chat.pending import DEMO_MARKER


class FakePool:
    made: list = []

    def __init__(self, checkpoint, workers, image_token_budget):
        self.checkpoint, self.workers, self.budget, self.closed = checkpoint, workers, image_token_budget, False
        self.broken = False
        FakePool.made.append(self)

    def failed(self):
        return self.broken

    def wait_warm(self, timeout_s):
        return True

    def token_strings(self, timeout_s):
        return ["a", "b", "<|im_end|>"]

    def close(self):
        self.closed = True


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setattr(prompt_worker, "PromptPool", FakePool)
    FakePool.made = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h = engine_hub.EngineHub(f"tcp://127.0.0.1:{port}", "token", 1, prompt_workers=3)
    yield h
    h.close()


def test_the_hello_keeps_workers_started_on_the_folder_it_loaded(hub, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "link").symlink_to(ckpt)
    hub.start_prompts(tmp_path / "link", 1024)
    assert len(FakePool.made) == 1 and FakePool.made[0].workers == 3
    hub.start_prompts(ckpt, 1024)                 # the hello names the resolved folder: kept
    assert len(FakePool.made) == 1 and not FakePool.made[0].closed and hub.prompts is FakePool.made[0]


def test_the_hello_starts_again_workers_whose_early_start_failed(hub, tmp_path):
    hub.start_prompts(tmp_path, 1024)
    FakePool.made[0].broken = True                # e.g. the folder was not whole when the front looked
    hub.start_prompts(tmp_path, 1024)
    assert [p.closed for p in FakePool.made] == [True, False] and hub.prompts is FakePool.made[1]


def test_workers_whose_load_failed_after_the_hello_are_started_again_before_ready(hub, tmp_path):
    from types import SimpleNamespace

    hub.start_prompts(tmp_path, 1024)            # the early start, still loading when the hello came
    hub.clients[0] = SimpleNamespace(setup={"checkpoint": str(tmp_path), "image_token_budget": 1024})
    FakePool.made[0].broken = True               # then its load failed
    hub._finish_setup()
    assert [p.closed for p in FakePool.made] == [True, False] and hub.ready.is_set() and hub.failure is None


def test_a_pool_on_a_folder_without_a_processor_says_it_failed(tmp_path):
    pool = prompt_worker.PromptPool(tmp_path, 1, 1024)  # an empty folder: the worker's processor cannot load
    try:
        assert pool.wait_warm(120), "the worker's start did not end"
        assert pool.failed()
    finally:
        pool.close()


def test_another_folder_or_budget_restarts_them_and_close_stops_them(hub, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    hub.start_prompts(a, 1024)
    hub.start_prompts(b, 1024)
    assert [p.closed for p in FakePool.made] == [True, False] and hub.prompts.checkpoint == b.resolve()
    hub.start_prompts(b, 256)
    assert len(FakePool.made) == 3 and hub.prompts.budget == 256
    hub.close()
    assert hub.prompts.closed
    hub.start_prompts(a, 1024)                    # nothing is started after close
    assert len(FakePool.made) == 3


def _checkpoint(folder):
    folder.mkdir(parents=True)
    for name in ("config.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    return folder


def test_the_front_finds_the_checkpoint_folder_before_the_engine_for_each_kind_of_model_value(tmp_path,
                                                                                              monkeypatch):
    """What the front's early start looks at: the tiny model once built (in ``--cache-dir``), a local folder, a
    hub id's snapshot in the Hugging Face cache (no network: ``local_files_only``); nothing for what the engine
    must still build or download, or for a folder without its tokenizer."""
    cache = tmp_path / "cache"
    assert folders.cached_checkpoint("tiny", cache) is None  # not built yet: the engine builds it
    tiny = _checkpoint(folders.tiny_checkpoint_dir(cache))
    assert folders.cached_checkpoint("tiny", cache) is None  # no weight index or demo marker: the engine rebuilds
    (tiny / folders.INDEX_FILE).write_text("{}")
    (tiny / DEMO_MARKER).write_text("demo")
    assert folders.cached_checkpoint("tiny", cache) == tiny
    local = _checkpoint(tmp_path / "my-ckpt")
    assert folders.cached_checkpoint(str(local)) == local.resolve()
    (local / "tokenizer_config.json").unlink()
    assert folders.cached_checkpoint(str(local)) is None
    hf = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hf))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert folders.cached_checkpoint("Qwen/Qwen3.5-9B") is None  # not downloaded: the engine downloads it
    commit = "0123456789abcdef0123456789abcdef01234567"
    (hf / "models--Qwen--Qwen3.5-9B" / "refs").mkdir(parents=True)
    (hf / "models--Qwen--Qwen3.5-9B" / "refs" / "main").write_text(commit)
    snapshot = _checkpoint(hf / "models--Qwen--Qwen3.5-9B" / "snapshots" / commit)
    assert folders.cached_checkpoint("Qwen/Qwen3.5-9B") == snapshot
    assert folders.cached_checkpoint("not a hub id!") is None
