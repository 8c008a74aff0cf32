"""Where a ``--model`` value's checkpoint folder is on this machine, without torch or transformers.

``loading.resolve_checkpoint`` builds (the tiny model) or downloads (a hub id) whatever is missing; the web
front, which never imports torch, calls ``cached_checkpoint`` at its start so that its prompt workers load the
tokenizer and image processor while the engine is still loading (otherwise they start only at the engine's
hello, and ``/healthz`` waits for them after the engine is ready).  The engine's hello names the folder it
loaded, and the prompt workers move to it if it differs (``EngineHub.start_prompts``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from qwen_chat.pending import DEMO_MARKER

#: Default ``--cache-dir``: where the built-in tiny checkpoint is built (hub downloads use ``HF_HOME``).
DEFAULT_CACHE_DIR = Path("~/.cache/qwen_chat")

#: Files a checkpoint needs for inference (a hub download takes these); weights of other formats, MTP-only
#: extras and docs are skipped.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.tiktoken", "*.model"]

#: Version of the built-in tiny checkpoint: bump whenever its config, weights recipe, tokenizer or template
#: changes; the cache folder name includes it, so an old build is never reused by mistake.
TINY_MODEL_VERSION = "4"  # 4: the published layout (sharded, MTP head, vocab.json/merges.txt)


#: The weight index of a sharded safetensors checkpoint (the published layout).
INDEX_FILE = "model.safetensors.index.json"


def tiny_is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole tiny checkpoint (its config, weight index and demo marker; the builder
    writes a temporary folder and renames it, so a half-written one never has this name)."""
    return all((Path(folder) / name).is_file() for name in ("config.json", INDEX_FILE, DEMO_MARKER))


def tiny_checkpoint_dir(cache_dir: Path) -> Path:
    """Folder where ``tiny.build_tiny_checkpoint(cache_dir)`` puts the current version (may not exist yet)."""
    return Path(cache_dir) / f"qwen3_5-tiny-v{TINY_MODEL_VERSION}"


def cached_checkpoint(model: str, cache_dir: Optional[Path] = None) -> Optional[Path]:
    """The folder ``loading.resolve_checkpoint(model, cache_dir)`` returns, if it is on this machine already
    with its tokenizer (``tokenizer_config.json``): a local folder, the tiny model once built, a hub id's
    snapshot in the Hugging Face cache.  None otherwise (not built or not downloaded yet, not a valid hub id).
    Never builds, downloads or reaches the network; raises nothing."""
    if model == "tiny":
        folder = tiny_checkpoint_dir(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser())
        if not tiny_is_complete(folder):  # the engine builds it (again)
            return None
    elif Path(model).expanduser().is_dir():
        folder = Path(model).expanduser().resolve()
    else:
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached, not a hub id: the engine's hello names the folder
            return None
    return folder if (folder / "tokenizer_config.json").is_file() and (folder / "config.json").is_file() else None
