"""The service's one typed, frozen configuration object, built from argv and the environment.

Usage: ``cfg = ServiceConfig.from_argv(sys.argv[1:])``.  Defaults live in code; ``validate()`` raises
``ConfigError`` with a message meant for the person starting the service.  Launcher arguments that DeepSpeed
appends (``--local_rank=N``) are accepted.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

DEFAULT_MODEL = "Qwen/Qwen3.5-9B"


MODEL_HINT = ("Pass --model PATH with a local Qwen3.5 checkpoint folder, or --model tiny for the built-in demo "
              "model (random weights, no download).")


def local_checkpoint_problem(model: str) -> Optional[str]:
    """Why ``--model`` cannot name a checkpoint, judged from the file system alone (no torch, no network).

    None for ``tiny``, for a folder holding ``config.json``, and for anything shaped like a hub id
    (``owner/name``, which only a download can settle).  Otherwise the reason, ending with ``MODEL_HINT``
    (which names ``--model PATH`` and ``--model tiny``).  Used by app.py before the heavy imports, so a wrong
    path fails within Supervisor's startsecs, and by ``loading.resolve_checkpoint``.
    """
    if model == "tiny":
        return None
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            return f"{local} has no config.json, so it is not a checkpoint folder. {MODEL_HINT}"
        return None
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        return f"No checkpoint folder at {model!r} and it is not a hub id (owner/name). {MODEL_HINT}"
    return None


class ConfigError(ValueError):
    """A start-up setting is wrong; the message says which and how to fix it."""


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServiceConfig:
    """Every start-up setting of the service.

    Units: ``port`` TCP port; ``image_token_budget`` visual tokens per image (1 token = one 32x32 px block);
    ``max_context`` tokens per sequence (None: the model's own limit, capped by ``engine_max_context``);
    ``max_upload_mb`` megabytes per file; ``collective_timeout_s`` seconds a worker rank waits for the next
    request on the gloo control group before it considers rank 0 gone.
    """

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 7860
    history_dir: Path = Path("history")
    local_rank: int = -1
    ds_config: Optional[Path] = None
    cache_dir: Optional[Path] = None  # where the built-in tiny model is written; None: ~/.cache/qwen_chat
    image_token_budget: int = 1024
    max_images_per_turn: int = 8
    max_upload_mb: float = 20.0
    max_context: Optional[int] = None
    max_queue: int = 64
    max_batch: int = 8
    device: Optional[str] = None  # "cpu", "cuda"; None: cuda if available
    users_file: Optional[Path] = None
    login: Optional[bool] = None  # None: on when bound beyond loopback
    api_keys: tuple[str, ...] = ()
    require_api_key: Optional[bool] = None  # None: required when bound beyond loopback
    allow_remote_images: bool = False
    collective_timeout_s: float = 7 * 24 * 3600.0

    @property
    def loopback(self) -> bool:
        return _is_loopback(self.host)

    @property
    def login_enabled(self) -> bool:
        return self.loopback is False if self.login is None else self.login

    @property
    def api_key_required(self) -> bool:
        if self.require_api_key is None:
            return (not self.loopback) or bool(self.api_keys)
        return self.require_api_key

    def validate(self) -> "ServiceConfig":
        """Raise ``ConfigError`` for an impossible setting; return self otherwise."""
        if not (0 < self.port < 65536):
            raise ConfigError(f"--port must be 1..65535, got {self.port}")
        if not (64 <= self.image_token_budget <= 16384):
            raise ConfigError(f"--image-token-budget must be 64..16384, got {self.image_token_budget}")
        if self.max_queue < 1 or self.max_batch < 1:
            raise ConfigError("--max-queue and --max-batch must be >= 1")
        if self.login_enabled and self.users_file is None:
            raise ConfigError(
                f"login is on (host {self.host} is not loopback) but no --users-file was given; "
                "create one with `python -m qwen_chat.web.auth add USER --users-file FILE` or pass --no-login"
            )
        if self.api_key_required and not self.api_keys:
            raise ConfigError(
                "API keys are required when bound beyond loopback: pass --api-key KEY (or set QWEN_CHAT_API_KEYS), "
                "or --no-api-key to allow unauthenticated API access"
            )
        if self.ds_config is not None and not Path(self.ds_config).is_file():
            raise ConfigError(f"--ds-config {self.ds_config} does not exist")
        return self

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="app.py", description="Qwen3.5 private multimodal chat service (web UI + OpenAI-compatible API)"
        )
        p.add_argument("--model", default=DEFAULT_MODEL,
                       help="hub id, local checkpoint folder, or 'tiny' (built-in random-weight demo model)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=7860)
        p.add_argument("--history-dir", type=Path, default=Path("history"))
        p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1,
                       help=argparse.SUPPRESS)
        p.add_argument("--ds-config", type=Path, default=None,
                       help="DeepSpeed config (tensor parallel or ZeRO-3); default: $QWEN_CHAT_DS_CONFIG or none")
        p.add_argument("--cache-dir", type=Path, default=None)
        p.add_argument("--image-token-budget", type=int, default=1024)
        p.add_argument("--max-images-per-turn", type=int, default=8)
        p.add_argument("--max-upload-mb", type=float, default=20.0)
        p.add_argument("--max-context", type=int, default=None)
        p.add_argument("--max-queue", type=int, default=64)
        p.add_argument("--max-batch", type=int, default=8)
        p.add_argument("--device", default=None, choices=["cpu", "cuda"])
        p.add_argument("--users-file", type=Path, default=None)
        g = p.add_mutually_exclusive_group()
        g.add_argument("--login", dest="login", action="store_true", default=None)
        g.add_argument("--no-login", dest="login", action="store_false")
        p.add_argument("--api-key", dest="api_keys", action="append", default=None,
                       help="accepted API key (repeatable); also $QWEN_CHAT_API_KEYS, comma-separated")
        g2 = p.add_mutually_exclusive_group()
        g2.add_argument("--no-api-key", dest="require_api_key", action="store_false", default=None)
        p.add_argument("--allow-remote-images", action="store_true")
        p.add_argument("--collective-timeout-s", type=float, default=7 * 24 * 3600.0)
        return p

    @classmethod
    def from_argv(cls, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> "ServiceConfig":
        """Parse argv (unknown arguments are an error, except DeepSpeed's ``--local_rank``)."""
        env = os.environ if env is None else env
        ns = cls.parser().parse_args(list(argv))
        keys = tuple(ns.api_keys or ()) + tuple(
            k.strip() for k in env.get("QWEN_CHAT_API_KEYS", "").split(",") if k.strip()
        )
        ds_config = ns.ds_config
        if ds_config is None and env.get("QWEN_CHAT_DS_CONFIG"):
            ds_config = Path(env["QWEN_CHAT_DS_CONFIG"])
        local_rank = ns.local_rank if ns.local_rank >= 0 else int(env.get("LOCAL_RANK", "-1"))
        return cls(
            model=ns.model,
            host=ns.host,
            port=ns.port,
            history_dir=ns.history_dir,
            local_rank=local_rank,
            ds_config=ds_config,
            cache_dir=ns.cache_dir,
            image_token_budget=ns.image_token_budget,
            max_images_per_turn=ns.max_images_per_turn,
            max_upload_mb=ns.max_upload_mb,
            max_context=ns.max_context,
            max_queue=ns.max_queue,
            max_batch=ns.max_batch,
            device=ns.device,
            users_file=ns.users_file,
            login=ns.login,
            api_keys=keys,
            require_api_key=ns.require_api_key,
            allow_remote_images=ns.allow_remote_images,
            collective_timeout_s=ns.collective_timeout_s,
        )
