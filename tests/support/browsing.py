"""What the real-browser tests share: headless Debian chromium through playwright, and what a user does and
sees on the chat page.

Fixtures (import them into a test module): ``browser`` (one chromium per module; skips when
/usr/bin/chromium is missing: ``bash deploy/install.sh --test`` installs Debian's package) and ``page`` (a
fresh 1280x900 tab per test; dialogs are recorded in ``page.dialogs`` and dismissed).

``shared_ui_server`` makes a module's one real server over ``FakeBackend.for_ui()`` (a module-scoped fixture
yields from it), ``open_fresh`` opens a test's page on it with the backend's script reset; ``users_file`` writes
a login users file.

Helpers: ``open_app``, ``send`` (type and press Enter, optionally with an image), ``bot_text`` / ``user_texts``
(what the chat shows), ``notice_text``, ``sidebar_labels``, ``field`` (the input of a labelled box by
``elem_id``).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator, Optional

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PAGE_LOAD_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.skip("Debian chromium is not installed (run: bash deploy/install.sh --test)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.dialogs = []
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    yield pg
    context.close()


#: The fields of the shared server's ``FakeBackend`` that a test may change; ``open_fresh`` resets them.
SCRIPT_FIELDS = ("answer", "step_delay_s", "fail_with", "ready", "max_steps", "cached_tokens")


def shared_ui_server(tmp_path_factory) -> Iterator[tuple]:
    """For a module-scoped fixture (``yield from``): one real server over ``FakeBackend.for_ui()`` and a
    history folder of its own; yields (``RunningServer``, backend, ``HistoryStore``)."""
    from qwen_chat.config import ServiceConfig
    from qwen_chat.history.store import HistoryStore
    from qwen_chat.web.server import build_app
    from tests.support.fake_backend import FakeBackend
    from tests.support.servers import RunningServer

    root = tmp_path_factory.mktemp("history")
    backend = FakeBackend.for_ui()
    store = HistoryStore(root)
    with RunningServer(build_app(ServiceConfig(history_dir=root), backend, store)) as running:
        yield running, backend, store


def open_fresh(pg, running, backend) -> None:
    """Reset the shared backend's script (``SCRIPT_FIELDS``) to ``FakeBackend.for_ui()``'s and open the page."""
    from tests.support.fake_backend import FakeBackend

    defaults = FakeBackend.for_ui()
    for name in SCRIPT_FIELDS:
        setattr(backend, name, getattr(defaults, name))
    open_app(pg, running.url)


def users_file(path: Path, passwords: dict) -> Path:
    """Write a login users file at ``path`` with ``passwords`` ({name: password}; fast hashes); returns it."""
    from qwen_chat.web import auth

    db = auth.UserDB()
    for name, password in passwords.items():
        db.set_password(name, password, rounds=4)
    db.save(path)
    return path


def open_app(pg, url: str) -> None:
    """Load the chat page and wait until its message box is there."""
    pg.goto(url)
    pg.wait_for_selector("#msg textarea", timeout=PAGE_LOAD_MS)


def send(pg, text: str, image: Optional[Path] = None) -> None:
    """Type ``text`` into the message box (after attaching ``image``) and press Enter."""
    if image is not None:
        pg.locator("#msg input[type=file]").set_input_files(str(image))
        pg.wait_for_selector("#msg img", timeout=30_000)  # the upload's thumbnail
    pg.locator("#msg textarea").fill(text)
    pg.locator("#msg textarea").press("Enter")


def bot_text(pg) -> str:
    """Everything the chat shows on the model's side (thoughts, answers, status labels)."""
    return "\n".join(pg.locator("#chatbot [data-testid=bot]").all_inner_texts())


def user_texts(pg) -> list[str]:
    """The user's messages as the chat shows them (image-only parts are empty strings)."""
    return [t.strip() for t in pg.locator("#chatbot [data-testid=user]").all_inner_texts()]


def notice_text(pg, where: str = "notice") -> str:
    """The notice line under the chat (``where="preset-notice"``: the one under the preset buttons)."""
    return pg.locator(f"#{where}").inner_text().strip()


def sidebar_labels(pg) -> list[str]:
    """The entries of the sidebar's conversation list, top first."""
    return [t.strip() for t in pg.locator("#conv-list label").all_inner_texts()]


def field(pg, elem_id: str):
    """The text input (or textarea) of the box with ``elem_id``."""
    return pg.locator(f"#{elem_id} input, #{elem_id} textarea").first
