"""The service's one typed, frozen configuration object, built from argv and the environment.

Usage: ``cfg = ServiceConfig.from_argv(sys.argv[1:]).validate()``.  Each setting is one field of
``ServiceConfig``: its default is the field's default, and its flag, help text, choices and environment variable
are the field's ``Option`` metadata, from which ``ServiceConfig.parser()`` is generated.  ``validate()`` raises
``ConfigError`` with a one-line message meant for the person starting the service (app.py prints it and exits 2).
Launcher arguments that DeepSpeed appends (``--local_rank=N``) are accepted.
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

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
class Option:
    """How one ``ServiceConfig`` field is set from the command line and the environment.

    Attributes:
        help: argparse help text (None: none; ``argparse.SUPPRESS``: the flag is hidden from ``--help``).
        flags: the flag names; default ``--field-name``.  For a bool field these flags set True (``()``: none).
        off: bool fields only: the flag that sets False (``--no-login``); with ``flags`` the two exclude each other.
        choices: the accepted values (checked by argparse and again by ``validate()``).
        env: environment variable read when no flag was given.  A blank value counts as unset; bool fields are
            False only for ``0``; choices are matched in lower case; a tuple field reads a comma-separated list
            and adds it to the flags' values instead of replacing them.
    """

    help: Optional[str] = None
    flags: Optional[tuple[str, ...]] = None
    off: Optional[str] = None
    choices: tuple[str, ...] = ()
    env: Optional[str] = None


def _opt(default: Any, **option: Any) -> Any:
    """A dataclass field with ``default`` and its command-line ``Option``."""
    return field(default=default, metadata={"option": Option(**option)})


def _option(f) -> Option:
    return f.metadata.get("option", Option())


def _flags(f) -> tuple[str, ...]:
    flags = _option(f).flags
    return ("--" + f.name.replace("_", "-"),) if flags is None else flags


def _value_type(hint: Any) -> Any:
    """``Optional[X]`` -> X; ``tuple[str, ...]`` -> tuple; otherwise the hint itself."""
    if typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


#: Sequences decoded together at most when ``--max-batch`` is not given: the largest decode batch with a CUDA
#: graph (``qwen_chat.engine.model.graphs.BATCH_LADDER``); the memory budget may hold fewer.
DEFAULT_MAX_SLOTS = 128

@dataclass(frozen=True)
class ServiceConfig:
    """Every start-up setting of the service.

    Units: ``port`` TCP port; ``image_token_budget`` visual tokens per image (1 token = one 32x32 px block);
    ``max_context`` tokens per sequence (None: the model's own limit as far as the memory budget holds it);
    ``max_batch`` sequences at once (None: what the budget holds, up to 128); ``gpu_memory_utilization`` a
    fraction of each GPU's memory; ``memory_budget_gib`` GiB (1 GiB = 2**30 bytes); ``prefill_chunk_tokens``
    tokens per engine step;
    ``max_upload_mb`` megabytes per file; ``collective_timeout_s`` seconds a worker rank waits for the next
    request on the gloo control group before it considers rank 0 gone.  ``tp_allreduce`` and ``tp_fused`` pick
    the tensor-parallel all-reduce kernels (``qwen_chat.engine.parallel.collectives.TensorParallelComm``).
    ``data_parallel``: replicas the launcher's ranks form (``qwen_chat.engine.parallel.layout.ReplicaLayout``).
    """

    model: str = _opt(DEFAULT_MODEL,
                      help="hub id, local checkpoint folder, or 'tiny' (built-in random-weight demo model)")
    host: str = "127.0.0.1"
    port: int = 7860
    history_dir: Path = Path("history")
    local_rank: int = _opt(-1, flags=("--local_rank", "--local-rank"), help=argparse.SUPPRESS, env="LOCAL_RANK")
    adapter: Optional[Path] = _opt(
        None, help="PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), merged into the "
                   "weights at start-up")
    quantize: Optional[str] = _opt(
        None, choices=("none", "fp8", "int4"), env="QWEN_CHAT_QUANTIZE",
        help="fp8: store the text decoder's linear weights as FP8 (e4m3, 128 x 128 block scales, the published "
             "FP8 checkpoint's format) at load time: about half the weight memory and bytes read per decode step. "
             "int4: store them as 4-bit integers in groups of 128 input columns (asymmetric round-to-nearest, "
             "W4A16): about a quarter.  An FP8 or 4-bit (GPTQ, AWQ, compressed-tensors) checkpoint needs no flag.  "
             "none: the checkpoint's weights as they are (overrides $QWEN_CHAT_QUANTIZE).  Default: "
             "$QWEN_CHAT_QUANTIZE or none")
    ds_config: Optional[Path] = _opt(
        None, env="QWEN_CHAT_DS_CONFIG",
        help="DeepSpeed config (tensor parallel or ZeRO-3); default: $QWEN_CHAT_DS_CONFIG or none")
    cache_dir: Optional[Path] = None  # where the built-in tiny model is written; None: ~/.cache/qwen_chat
    image_token_budget: int = 1024
    max_images_per_turn: int = 8
    max_upload_mb: float = 20.0
    max_context: Optional[int] = _opt(
        None, help="tokens per sequence at most (prompt + reply); default: the model's own limit, as far as the "
                   "memory budget holds it")
    max_queue: int = 64
    stream_interval: int = _opt(
        1, help="tokens per streamed update at most for a client that keeps up (vLLM's --stream-interval); a "
                "slower client gets what accumulated merged into one update either way")
    prompt_workers: Optional[int] = _opt(
        None, help="processes of the web front that build prompts (chat template, tokenization, images), so that "
                   "a large request never stalls the running streams; default: a quarter of the CPU cores, 2 to "
                   "8 (each holds about 0.75 GB)")
    max_request_mb: float = _opt(
        0.0, help="largest API request body in MB (1 MB = 2**20 bytes), refused with 413 before it is read; "
                  "default: what --max-images-per-turn images of --max-upload-mb each take as base64, plus 1 MB")
    max_batch: Optional[int] = _opt(
        None, help="sequences decoded together at most; default: as many as the memory budget holds, up to 128 "
                   "(the largest decode batch with a CUDA graph; larger ones run without)")
    gpu_memory_utilization: float = _opt(
        0.90, help="fraction of each GPU's memory the service may use in all (weights, activations, KV cache and "
                   "state); what the weights and activations leave is the memory budget of the sequences")
    memory_budget_gib: Optional[float] = _opt(
        None, help="GiB for the sequences' state (KV blocks + Gated DeltaNet slots) instead of what "
                   "--gpu-memory-utilization leaves; default on CPU: 0.25")
    prefill_chunk_tokens: Optional[int] = _opt(
        None, help="prompt tokens prefilled in one engine step at most (longer prompts go in chunks, mixed with "
                   "the running streams' decode steps, which each chunk delays); default: 4096, less on a GPU "
                   "with little memory left after the weights")
    conversation_cache: bool = _opt(
        True, off="--no-conversation-cache",
        help="keep each conversation's state where its next turn continues, so that a follow-up prefills only "
             "what is new (the default; kept states use the memory no running sequence needs); "
             "--no-conversation-cache turns it off")
    kv_cache_dtype: str = _opt("auto", choices=("auto", "fp8"), help=(
        "fp8: attention keys and values kept as FP8 (e4m3, a scale per position and KV head): about twice the tokens "
        "of KV cache (docs/checkpoints.md); needs compute capability 8.9+ (Ada, Hopper) or the CPU.  auto: bf16"))
    speculative_tokens: int = _opt(
        0, help="draft tokens per step of speculative decoding with the checkpoint's MTP head (1-3; 0: off, the "
                "default); a step keeps the drafts the model agrees with, so the output is unchanged")
    speculative_max_batch: int = _opt(8, help="decode batches larger than this never speculate")
    device: Optional[str] = _opt(None, choices=("cpu", "cuda"))  # None: cuda if available
    users_file: Optional[Path] = None
    login: Optional[bool] = _opt(None, off="--no-login")  # None: on when bound beyond loopback
    api_keys: tuple[str, ...] = _opt(
        (), flags=("--api-key",), env="QWEN_CHAT_API_KEYS",
        help="accepted API key (repeatable); also $QWEN_CHAT_API_KEYS, comma-separated")
    require_api_key: Optional[bool] = _opt(None, flags=(), off="--no-api-key")  # None: required beyond loopback
    allowed_origins: tuple[str, ...] = _opt(
        (), help="web origin (scheme://host[:port], or * for any) whose pages may call the API from a browser "
                 "(repeatable); default none: a browser request from another site's page is refused (403); "
                 "scripts and SDKs, which send no Origin header, are not affected")
    allow_remote_images: bool = False
    collective_timeout_s: float = 7 * 24 * 3600.0
    data_parallel: int = _opt(
        1, env="DATA_PARALLEL",
        help="independent replicas of the model over the launcher's ranks (each a tensor-parallel group of "
             "world / N ranks) behind the one web port; default: $DATA_PARALLEL or 1")
    tp_allreduce: str = _opt(
        "auto", choices=("auto", "symm_mem", "nccl"), env="QWEN_CHAT_TP_ALLREDUCE",
        help="tensor parallel all-reduce: auto (symmetric memory where it works, else NCCL), symm_mem or nccl; "
             "default: $QWEN_CHAT_TP_ALLREDUCE or auto")
    tp_fused: bool = _opt(
        True, off="--no-tp-fused", env="QWEN_CHAT_TP_FUSED",
        help="tensor parallel: fuse each all-reduce with the next residual add and RMSNorm (the default; "
             "--no-tp-fused or QWEN_CHAT_TP_FUSED=0 turns it off)")

    @property
    def prompt_worker_count(self) -> int:
        """``--prompt-workers``, else a quarter of the CPU cores, 2 to 8: a burst's prompts are built one after the
        other in each worker (~5 ms per 600-word prompt on one core: 2 workers queued a 32-prompt burst up to
        ~80 ms; docs/performance.md, "What the 32-stream TTFT still waits for")."""
        return self.prompt_workers or max(2, min(8, (os.cpu_count() or 2) // 4))

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
        """Return self, or raise ``ConfigError`` (one line) for a setting the service cannot start with.

        Checks the ranges (``--port`` 1..65535, ``--image-token-budget`` 64..16384, ``--max-queue`` and
        ``--max-batch`` >= 1, ``--gpu-memory-utilization`` 0.05..1, ``--memory-budget-gib`` > 0,
        ``--prefill-chunk-tokens`` >= 16, ``--max-upload-mb`` at least one byte, ``--max-context`` >= 1,
        ``--collective-timeout-s`` > 0, ``--data-parallel`` >= 1), the choices, login and API-key requirements,
        that every ``--allowed-origins`` value is an origin (``web.origins.origin_problem``),
        that ``--ds-config`` exists, that ``--adapter`` is a folder with ``adapter_config.json``, when login is on,
        that the users file can be read and parsed (``auth.UserDB.from_file``), and last that ``--history-dir`` is
        a writable folder (created here when missing).
        """
        if not (0 < self.port < 65536):
            raise ConfigError(f"--port must be 1..65535, got {self.port}")
        if not (64 <= self.image_token_budget <= 16384):
            raise ConfigError(f"--image-token-budget must be 64..16384, got {self.image_token_budget}")
        if self.max_queue < 1 or (self.max_batch is not None and self.max_batch < 1):
            raise ConfigError(f"--max-queue and --max-batch must be >= 1, got {self.max_queue} and {self.max_batch}")
        if self.prompt_workers is not None and not (1 <= self.prompt_workers <= 64):
            raise ConfigError(f"--prompt-workers must be 1..64, got {self.prompt_workers}")
        if self.stream_interval < 1:
            raise ConfigError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if not (math.isfinite(self.max_request_mb) and self.max_request_mb >= 0):
            raise ConfigError(f"--max-request-mb must be >= 0 (0: the default), got {self.max_request_mb:g}")
        if not (0.05 <= self.gpu_memory_utilization <= 1.0):
            raise ConfigError(f"--gpu-memory-utilization must be 0.05..1.0, got {self.gpu_memory_utilization:g}")
        if self.memory_budget_gib is not None and not (0 < self.memory_budget_gib < math.inf):
            raise ConfigError(f"--memory-budget-gib must be > 0, got {self.memory_budget_gib:g}")
        if not 0 <= self.speculative_tokens <= 3 or self.speculative_max_batch < 1:
            raise ConfigError(f"--speculative-tokens must be 0-3 and --speculative-max-batch >= 1, got "
                              f"{self.speculative_tokens} and {self.speculative_max_batch}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 16:
            raise ConfigError(f"--prefill-chunk-tokens must be >= 16, got {self.prefill_chunk_tokens}")
        if not (math.isfinite(self.max_upload_mb) and self.max_upload_mb * 1024 * 1024 >= 1):
            raise ConfigError(f"--max-upload-mb must be > 0 (at least one byte), got {self.max_upload_mb:g}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"--max-context must be >= 1, got {self.max_context}")
        if not (0 < self.collective_timeout_s < math.inf):
            raise ConfigError(f"--collective-timeout-s must be > 0, got {self.collective_timeout_s:g}")
        if self.data_parallel < 1:
            raise ConfigError(f"--data-parallel (or $DATA_PARALLEL) must be >= 1, got {self.data_parallel}")
        for f in fields(self):
            choices, value = _option(f).choices, getattr(self, f.name)
            if choices and value is not None and value not in choices:
                env = _option(f).env
                where = _flags(f)[0] + (f" (or ${env})" if env else "")
                raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
        if self.login_enabled and self.users_file is None:
            why = "--login was given" if self.login else f"host {self.host} is not loopback"
            raise ConfigError(
                f"login is on ({why}) but no --users-file was given; "
                "create one with `python -m qwen_chat.web.auth add USER --users-file FILE` or pass --no-login"
            )
        if self.api_key_required and not self.api_keys:
            raise ConfigError(
                "API keys are required when bound beyond loopback: pass --api-key KEY (or set QWEN_CHAT_API_KEYS), "
                "or --no-api-key to allow unauthenticated API access"
            )
        from qwen_chat.web.origins import origin_problem

        for origin in self.allowed_origins:
            problem = origin_problem(origin)
            if problem:
                raise ConfigError(f"--allowed-origins {origin!r}: {problem}")
        if self.ds_config is not None and not Path(self.ds_config).is_file():
            raise ConfigError(f"--ds-config {self.ds_config} does not exist")
        if self.adapter is not None and not (Path(self.adapter) / "adapter_config.json").is_file():
            what = "has no adapter_config.json" if Path(self.adapter).is_dir() else "is not a folder"
            raise ConfigError(f"--adapter {self.adapter} {what} (expected a PEFT LoRA adapter folder)")
        if self.login_enabled:
            self._check_users_file()
        self._check_history_dir()  # last: a refused setting above leaves no new folder behind
        return self

    def _check_history_dir(self) -> None:
        """Create ``--history-dir`` if missing and check it is a writable folder, so a bad one fails here."""
        path = Path(self.history_dir).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"--history-dir {self.history_dir} is not a folder") from None
        except OSError as e:
            raise ConfigError(f"--history-dir {self.history_dir} cannot be created: {e.strerror or e}") from None
        if not path.is_dir():
            raise ConfigError(f"--history-dir {self.history_dir} is not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"--history-dir {self.history_dir} is not writable")

    def _check_users_file(self) -> None:
        """Load the users file the way the web server will, so that a bad one fails here in one line."""
        from qwen_chat.web import auth  # bcrypt and the standard library only: no torch, no gradio

        try:
            auth.UserDB.from_file(self.users_file)
        except auth.UsersFileError as e:
            raise ConfigError(str(e)) from None
        except UnicodeDecodeError:
            raise ConfigError(f"users file {self.users_file} is not UTF-8 text") from None
        except OSError as e:
            raise ConfigError(f"cannot read users file {self.users_file}: {e.strerror or e}") from None

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """The command line, generated from the fields: each field's flags, type (from its annotation), choices
        and help.  No flag carries a default (``argparse.SUPPRESS``): a flag left out is absent from the parsed
        namespace and ``from_argv`` takes the environment variable or the field's default."""
        p = argparse.ArgumentParser(
            prog="app.py", description="Qwen3.5 private multimodal chat service (web UI + OpenAI-compatible API)"
        )
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            opt, kind = _option(f), _value_type(hints[f.name])
            common = dict(dest=f.name, default=argparse.SUPPRESS)
            if kind is bool:
                group = p.add_mutually_exclusive_group() if _flags(f) and opt.off else p
                if _flags(f):
                    group.add_argument(*_flags(f), action="store_true", help=opt.help, **common)
                if opt.off:
                    group.add_argument(opt.off, action="store_false", **common)
            elif kind is tuple:
                p.add_argument(*_flags(f), action="append", help=opt.help, **common)
            else:
                p.add_argument(*_flags(f), type=None if kind is str else kind, choices=opt.choices or None,
                               help=opt.help, **common)
        return p

    @classmethod
    def from_argv(cls, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> "ServiceConfig":
        """Parse argv (unknown arguments are an error, except DeepSpeed's ``--local_rank``) and the environment.

        Precedence per field: the flag, else its environment variable (``Option.env``), else the field's
        default; API keys from ``$QWEN_CHAT_API_KEYS`` are added to the ``--api-key`` ones.

        Raises:
            SystemExit(2): a bad command line (argparse prints the usage and the error).
            ConfigError: an environment variable that cannot be read as its field's type.
        """
        env = os.environ if env is None else env
        given = vars(cls.parser().parse_args(list(argv)))
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            name, kind = _option(f).env, _value_type(hints[f.name])
            raw = env.get(name, "") if name else ""
            from_env = _from_env(name, raw, kind, bool(_option(f).choices)) if raw.strip() else None
            if kind is tuple:
                values[f.name] = tuple(given.get(f.name) or ()) + (from_env or ())
            elif f.name in given:
                values[f.name] = given[f.name]
            elif from_env is not None:
                values[f.name] = from_env
        return cls(**values)


def _from_env(name: str, raw: str, kind: Any, lower: bool) -> Any:
    """The value of environment variable ``name`` (non-blank ``raw``) as a field of type ``kind``."""
    text = raw.strip()
    if kind is bool:
        return text != "0"
    if kind is tuple:
        return tuple(k.strip() for k in text.split(",") if k.strip())
    if kind is Path:
        return Path(raw)
    if kind is str:
        return text.lower() if lower else text
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"${name} must be a number, got {raw!r}") from None

