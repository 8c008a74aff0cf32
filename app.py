"""Composition root of the Qwen3.5 chat service: config -> engine -> (rank 0) web server.

    python app.py --model tiny                      # CPU demo model with random weights
    python app.py --model Qwen/Qwen3.5-9B --host 0.0.0.0 --users-file users.txt --api-key KEY
    bash start.sh ...                               # the same through the (DeepSpeed) launcher

Exit codes: 0 after a clean shutdown, 1 when the model or engine cannot start, 2 for a bad command line.
Nothing heavy happens at import time; worker ranks never return from ``start_engine``.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

log = logging.getLogger("qwen_chat")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the command line, start the engine, and serve the UI + API on ``cfg.host:cfg.port``."""
    from qwen_chat.config import ConfigError, ServiceConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = ServiceConfig.from_argv(sys.argv[1:] if argv is None else argv).validate()
    except ConfigError as e:
        print(f"app.py: configuration error: {e}", file=sys.stderr)
        return 2

    from qwen_chat.engine import bootstrap
    from qwen_chat.history.store import HistoryStore

    try:
        engine = bootstrap.start_engine(cfg)  # worker ranks stay inside and never return
    except bootstrap.StartupError as e:
        print(f"app.py: cannot start the engine: {e}", file=sys.stderr)
        return 1

    import uvicorn

    from qwen_chat.web.server import build_app

    app = build_app(cfg, engine, HistoryStore(cfg.history_dir))
    log.info("serving http://%s:%d (model %s)", cfg.host, cfg.port, engine.info.name)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info", timeout_graceful_shutdown=10)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
