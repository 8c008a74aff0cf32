"""Files the page hands out are served to their owner only, and the temporary copies behind them do not pile up.

The chat page shows stored images and offers downloads through Gradio's file route
(``/gradio_api/file=<path>``, the older ``/file=<path>`` too): Gradio copies each file into its cache under a
directory named by a hash of the content and serves it to anyone who has the URL.  ``FileGuard`` (an ASGI
middleware in front of the whole app) narrows that to the file's owner:

- a stored image (named ``<sha256>.png``, ``history.records.IMAGE_NAME``) only when the requesting user's own
  image folder holds that image: a user who never had the picture gets 404, and once the last conversation
  using it is deleted (the store removes the image) nobody gets it any more;
- a download the page prepared (``grant(user, path)``, by file name; every ``.zip``) only for the users it was
  prepared for;
- anything else (Gradio's own assets, a user's fresh upload) as before.

The requesting user is Gradio's: the login cookie's user with login on, ``local`` with login off.  A refused
request gets the same 404 as a file that does not exist (nothing says whether it does).

The temporary copies live in ``temp_root()``, ``<system temp>/qwen_chat-<uid>``, a folder only this user can
open (0700): ``render.view_path``'s ``qwen_chat_view/``, the ``qwen_chat_export_*`` export folders and
``qwen_chat_download/<conversation>/``.  (They were under the shared temp folder itself: another local user
could read the downloads, and the first user's folders kept a second user's service from writing there.)
``sweep(max_age_s)`` removes those older than ``max_age_s``: those older than
``STARTUP_MAX_AGE_S`` when the web front starts, and those older than ``COPY_MAX_AGE_S`` every ``SWEEP_EVERY_S``
while it runs (a copy is
made again whenever a page shows the image).  Gradio's own cached copies are removed by Gradio
(``gr.Blocks(delete_cache=...)``, ``ui.DELETE_CACHE``).
"""
from __future__ import annotations

import collections
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import unquote

from qwen_chat.history.records import IMAGE_NAME

log = logging.getLogger(__name__)

#: URL path prefixes of Gradio's file route (the page is mounted at "/").
FILE_ROUTES = ("/gradio_api/file=", "/file=")
#: Names of the service's temporary copies in ``temp_root()``: shown images, exports (API), downloads (one
#: folder per conversation).
VIEW_DIR, EXPORT_PREFIX, DOWNLOAD_DIR = "qwen_chat_view", "qwen_chat_export_", "qwen_chat_download"
#: A temporary copy older than this (seconds) is removed by the periodic sweep (it is re-made when shown again).
COPY_MAX_AGE_S = 24 * 3600.0
#: Seconds between sweeps while the front runs.
SWEEP_EVERY_S = 3600.0
#: At start-up, copies older than this (seconds) go: all an earlier run left, but not one another service of the
#: same user on this machine (same ``temp_root()``) made a moment ago and is handing to Gradio right now.
STARTUP_MAX_AGE_S = 60.0
#: Download names remembered (oldest forgotten first); a forgotten download answers 404, like an expired one.
MAX_GRANTS = 10_000
#: What the page's downloads are (a conversation as a zip): served only when granted, to its users.
DOWNLOAD_SUFFIXES = (".zip",)


class Grants:
    """Which users may fetch which prepared download (by file name); thread-safe, bounded to ``MAX_GRANTS``."""

    def __init__(self, limit: int = MAX_GRANTS) -> None:
        self._owners: "collections.OrderedDict[str, set[str]]" = collections.OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def grant(self, user: str, path: "str | os.PathLike") -> None:
        """Let ``user`` fetch the file named like ``path`` (its base name) through the file route."""
        name = Path(path).name
        with self._lock:
            self._owners.setdefault(name, set()).add(user)
            self._owners.move_to_end(name)
            while len(self._owners) > self._limit:
                self._owners.popitem(last=False)

    def owners(self, name: str) -> Optional[frozenset]:
        """The users granted ``name``, or None when it was never granted (not a prepared download)."""
        with self._lock:
            found = self._owners.get(name)
            return frozenset(found) if found is not None else None


#: The web front's downloads (one front process serves every user).
GRANTS = Grants()


def grant(user: str, path: "str | os.PathLike") -> None:
    """Record in ``GRANTS`` that ``user`` may fetch the prepared download ``path``."""
    GRANTS.grant(user, path)


def requested_name(path: str) -> Optional[str]:
    """The base name of the file a request path asks for (``/gradio_api/file=/tmp/gradio/<hash>/x.png`` ->
    ``x.png``), or None when the path is not Gradio's file route."""
    for prefix in FILE_ROUTES:
        if path.startswith(prefix):
            target = unquote(path[len(prefix):]).replace("\\", "/").rstrip("/")
            return target.rsplit("/", 1)[-1] or None
    return None


class FileGuard:
    """ASGI middleware: requests for Gradio's file route are answered 404 unless the user owns the file (module
    docstring).

    Args:
        app: the ASGI application behind it.
        user_of: scope -> the requesting user name, or None when nobody is logged in.
        images_root: ``history_dir/users``: user ``u``'s images are ``images_root/u/images/<name>``.
        grants: the prepared downloads (default ``GRANTS``).
    """

    def __init__(self, app, *, user_of: Callable[[dict], Optional[str]], images_root: Path,
                 grants: Grants = GRANTS) -> None:
        self.app, self.user_of, self.images_root, self.grants = app, user_of, Path(images_root), grants

    def allowed(self, name: str, user: Optional[str]) -> bool:
        """Whether ``user`` may fetch a file named ``name`` (True for files this module does not own)."""
        if IMAGE_NAME.fullmatch(name):
            return bool(user) and "/" not in user and (self.images_root / user / "images" / name).is_file()
        owners = self.grants.owners(name)
        if owners is None:  # never granted (or forgotten): a download only if it is the page's kind of file
            return not name.lower().endswith(DOWNLOAD_SUFFIXES)
        return user is not None and user in owners

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            name = requested_name(scope.get("path", ""))
            if name is not None and not self.allowed(name, self.user_of(scope)):
                await _not_found(send)
                return
        await self.app(scope, receive, send)


async def _not_found(send) -> None:
    body = b'{"detail":"Not Found"}'
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def gradio_user_of(app, login_enabled: bool, local_user: str = "local") -> Callable[[dict], Optional[str]]:
    """scope -> the user Gradio sees: ``local_user`` with login off; with login on the user of the request's
    Gradio login cookie (``access-token-<cookie id>`` in the tokens of the Gradio app mounted in ``app``),
    None without a valid one."""
    if not login_enabled:
        return lambda scope: local_user

    def user_of(scope) -> Optional[str]:
        from gradio.routes import App as GradioApp
        from starlette.requests import Request

        mounted = next((getattr(r, "app", None) for r in app.routes if isinstance(getattr(r, "app", None),
                                                                                    GradioApp)), None)
        if mounted is None:
            return None
        cookies = Request(scope).cookies
        token = (cookies.get(f"access-token-{mounted.cookie_id}")
                 or cookies.get(f"access-token-unsecure-{mounted.cookie_id}"))
        return mounted.tokens.get(token) if token else None

    return user_of


def temp_root() -> Path:
    """The folder of this user's temporary copies, ``<system temp>/qwen_chat-<uid>``, made owner-only (0700) on
    first use.  Raises ``OSError`` when that name is taken by something that is not this user's folder (a
    symbolic link, another user's folder): nothing is written where someone else could read it."""
    root = Path(tempfile.gettempdir()) / f"qwen_chat-{os.getuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{root} is not a folder of this user; remove it or set TMPDIR")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(root, 0o700)
    return root


def sweep(max_age_s: float, temp_dir: Optional[Path] = None, now: Optional[float] = None) -> int:
    """Remove the service's temporary copies (module docstring) last changed more than ``max_age_s`` seconds
    ago (0: all); returns how many files and folders went.  Errors (a file in use elsewhere, permissions) are
    logged and skipped."""
    root = Path(temp_dir) if temp_dir else temp_root()
    cutoff = (time.time() if now is None else now) - max_age_s
    removed = 0
    candidates = [p for p in (root / VIEW_DIR).glob("*") if p.is_file()] if (root / VIEW_DIR).is_dir() else []
    candidates += [p for p in root.glob(EXPORT_PREFIX + "*") if p.is_dir()]
    if (root / DOWNLOAD_DIR).is_dir():
        candidates += [p for p in (root / DOWNLOAD_DIR).glob("*") if p.is_dir()]
    for path in candidates:
        try:
            if max_age_s > 0 and path.stat().st_mtime > cutoff:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed += 1
        except OSError as e:
            log.warning("could not remove the temporary copy %s: %s", path, e.strerror or e)
    return removed


def start_sweeper(every_s: float = SWEEP_EVERY_S, max_age_s: float = COPY_MAX_AGE_S) -> threading.Thread:
    """Sweep the copies older than ``STARTUP_MAX_AGE_S`` now (a start of the front: what an earlier run left),
    then every ``every_s`` seconds those older than ``max_age_s``, in a daemon thread; returns it."""
    gone = sweep(STARTUP_MAX_AGE_S)
    if gone:
        log.info("removed %d temporary copies left by an earlier run", gone)

    def loop() -> None:
        while True:
            time.sleep(every_s)
            sweep(max_age_s)

    thread = threading.Thread(target=loop, name="temp-sweeper", daemon=True)
    thread.start()
    return thread
