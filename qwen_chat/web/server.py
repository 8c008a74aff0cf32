"""The one FastAPI application of the service: ``/healthz``, ``/metrics``, ``/v1/...`` and the Gradio UI at ``/``.

``build_app(cfg, backend, store) -> FastAPI`` is called by ``app.py`` on rank 0 only (worker ranks never
serve).  The backend is wrapped once by ``ops.instrument`` and that one object is shared by the UI and the API,
so metrics count both.  Login (``cfg.login_enabled``) protects the UI through Gradio's ``auth=`` with
``auth.UserDB.verify``; the API has its own keys (``cfg.api_keys``).

``end_streams(app)`` ends the Gradio heartbeat stream that every open browser tab holds; ``front.WebServer``
calls it when the server begins to shut down, so a stop does not wait for those streams (they never end by
themselves).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

import gradio as gr
from gradio.routes import App as GradioApp

from qwen_chat.chat_types import ChatBackend
from qwen_chat.config import ServiceConfig
from qwen_chat.images import ImageLimits
from qwen_chat.web import api, auth, file_access, ops
from qwen_chat.web.handlers import ChatController
from qwen_chat.web.login_guard import LoginGuard
from qwen_chat.web.page_extras import PAGE_HEAD
from qwen_chat.web.page_js import PAGE_HEAD as LIVE_HEAD
from qwen_chat.web.ui import CSS, build_ui


def build_app(cfg: ServiceConfig, backend: ChatBackend, store: Any) -> FastAPI:
    """Assemble the server around an already started backend and a ``HistoryStore``.

    Raises ``auth.UsersFileError`` when login is on and the users file cannot be read, ``ValueError`` (from
    ``ImageLimits.from_config``) for a non-positive upload size or image token budget.
    """
    limits = ImageLimits.from_config(cfg)
    served = ops.instrument(backend)
    app = FastAPI(title="Qwen3.5 chat", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(ops.create_router(served))
    api.install(app, served, cfg)
    controller = ChatController(served, store, limits=limits, max_images_per_turn=cfg.max_images_per_turn)
    page = build_ui(controller, max_queue=cfg.max_queue, login_enabled=cfg.login_enabled)
    guard = LoginGuard(auth.UserDB.from_file(cfg.users_file).verify) if cfg.login_enabled else None
    app = gr.mount_gradio_app(
        app, page, path="/", auth=guard.verify if guard else None, auth_message="Qwen3.5 chat: please log in",
        max_file_size=limits.max_file_bytes, footer_links=["settings"], css=CSS, ssr_mode=False,
        head=PAGE_HEAD + LIVE_HEAD,  # kept versions and list menu (page.js); statistics, keys, banner
    )
    if guard is not None:  # password checks off the event loop, wrong guesses limited, no cross-site logins
        app.add_middleware(LoginGuard.Middleware, guard=guard)
    # stored images and prepared downloads through Gradio's file route: their owner only
    app.add_middleware(file_access.FileGuard, user_of=file_access.gradio_user_of(app, cfg.login_enabled),
                       images_root=store.root / "users")
    return app


def end_streams(app: FastAPI) -> None:
    """Make the heartbeat stream of every open tab of ``app``'s Gradio UI end now (Gradio's own stop event,
    which its heartbeat loop waits on; the tab reconnects to the next server).  Call it in the server's event
    loop: the event is an ``asyncio.Event``."""
    for route in app.routes:
        mounted = getattr(route, "app", None)
        if isinstance(mounted, GradioApp):
            mounted.stop_event.set()
