"""qwen_chat.web.file_access: the file route serves a stored image only to a user who has it, a prepared
download only to the users it was prepared for, everything else as before; the temporary copies are swept."""
from __future__ import annotations

import os
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from qwen_chat.web import file_access
from qwen_chat.web.file_access import FileGuard, Grants, requested_name, sweep

ALICE_IMG = "a" * 64 + ".png"
BOB_IMG = "b" * 64 + ".png"


@pytest.fixture
def served(tmp_path):
    """(client factory by user, grants): Gradio's file route stand-in (200 'served X') behind a FileGuard whose
    user comes from an ``X-User`` header; alice owns ALICE_IMG, bob owns BOB_IMG."""
    root = tmp_path / "users"
    for user, name in (("alice", ALICE_IMG), ("bob", BOB_IMG)):
        (root / user / "images").mkdir(parents=True)
        (root / user / "images" / name).write_bytes(b"png")

    async def file_route(request):
        return PlainTextResponse("served " + request.path_params["p"])

    inner = Starlette(routes=[Route("/gradio_api/file={p:path}", file_route), Route("/file={p:path}", file_route),
                              Route("/other/{p:path}", file_route)])

    def user_of(scope):
        return dict(scope["headers"]).get(b"x-user", b"").decode() or None

    grants = Grants(limit=3)
    client = TestClient(FileGuard(inner, user_of=user_of, images_root=root, grants=grants))

    def get(path, user=None):
        return client.get(path, headers={"X-User": user} if user else {})

    return get, grants


def test_a_stored_image_only_for_a_user_who_has_it(served, tmp_path):
    get, _ = served
    url = f"/gradio_api/file=/tmp/gradio/0123abcd/{ALICE_IMG}"
    assert get(url, "alice").text == f"served /tmp/gradio/0123abcd/{ALICE_IMG}"
    for other in ("bob", None, "../alice"):
        r = get(url, other)
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert get(f"/file=/tmp/gradio/x/{BOB_IMG}", "alice").status_code == 404  # the older route too
    assert get(f"/gradio_api/file=%2Ftmp%2Fgradio%2Fx%2F{BOB_IMG}", "bob").status_code == 200  # URL-encoded
    # the last conversation using it deleted (the store removes the image): nobody gets it any more
    (tmp_path / "users" / "alice" / "images" / ALICE_IMG).unlink()
    assert get(url, "alice").status_code == 404


def test_a_prepared_download_only_for_its_users_and_other_files_as_before(served):
    get, grants = served
    grants.grant("alice", "/tmp/qwen_chat_export_x/Trip planning.zip")
    url = "/gradio_api/file=/tmp/gradio/feed/Trip%20planning.zip"
    assert get(url, "alice").status_code == 200
    assert get(url, "bob").status_code == 404 and get(url).status_code == 404
    grants.grant("bob", "/elsewhere/Trip planning.zip")  # bob exported a chat of the same title
    assert get(url, "bob").status_code == 200
    # files the page did not hand out (Gradio's assets, a fresh upload) and other routes: unchanged
    assert get("/gradio_api/file=/tmp/gradio/abc/holiday.jpg", "bob").status_code == 200
    assert get(f"/other/{ALICE_IMG}", "bob").status_code == 200
    for n in range(3):  # the oldest grant is forgotten past the limit: it answers 404, like an expired file
        grants.grant("carol", f"/x/{n}.zip")
    assert get(url, "alice").status_code == 404


def test_requested_name():
    assert requested_name("/gradio_api/file=/tmp/gradio/h/x.png") == "x.png"
    assert requested_name("/file=C:\\tmp\\h\\y.zip") == "y.zip"
    assert requested_name("/gradio_api/upload") is None and requested_name("/gradio_api/file=") is None


def test_sweep_removes_old_copies_and_keeps_fresh_ones(tmp_path):
    view = tmp_path / file_access.VIEW_DIR
    view.mkdir()
    old_img, new_img = view / ALICE_IMG, view / BOB_IMG
    old_dir = tmp_path / (file_access.EXPORT_PREFIX + "old")
    new_dir = tmp_path / (file_access.EXPORT_PREFIX + "new")
    old_dl = tmp_path / file_access.DOWNLOAD_DIR / "conv1"
    old_dl.mkdir(parents=True)
    (old_dl / "Trip.zip").write_bytes(b"zip")
    for d in (old_dir, new_dir):
        d.mkdir()
        (d / "chat.zip").write_bytes(b"zip")
    for f in (old_img, new_img):
        f.write_bytes(b"png")
    unrelated = tmp_path / "someone_elses.txt"
    unrelated.write_text("keep")
    day_ago = time.time() - 2 * 86400
    for p in (old_img, old_dir, old_dl):
        os.utime(p, (day_ago, day_ago))
    assert sweep(86400, temp_dir=tmp_path) == 3
    assert not old_img.exists() and not old_dir.exists() and not old_dl.exists()
    assert new_img.exists() and new_dir.exists() and unrelated.exists()
    assert sweep(0, temp_dir=tmp_path) == 2 and not new_img.exists() and not new_dir.exists()
    assert unrelated.read_text() == "keep"


def test_temporary_copies_live_in_a_folder_only_this_user_can_open(tmp_path, monkeypatch):
    monkeypatch.setattr(file_access.tempfile, "gettempdir", lambda: str(tmp_path))
    root = file_access.temp_root()
    assert root == tmp_path / f"qwen_chat-{os.getuid()}" and root.is_dir()
    assert (root.stat().st_mode & 0o777) == 0o700
    root.chmod(0o755)  # loosened by someone: made private again
    assert file_access.temp_root() == root and (root.stat().st_mode & 0o777) == 0o700
    root.rmdir()
    (tmp_path / "elsewhere").mkdir()
    root.symlink_to(tmp_path / "elsewhere")  # a link planted under the name: refused, nothing written there
    with pytest.raises(OSError, match="not a folder of this user"):
        file_access.temp_root()
