"""The service benchmark's checkpoint: random bf16 weights of the full published Qwen3.5-9B config, on disk.

``bench/serve_bench.py`` starts the service on a real checkpoint folder, loaded by the service's own loader
(``qwen_chat.engine.checkpoints.loading``), so it needs one that looks published: ``config.json`` of
``bench/qwen3_5_9b_config.json``, four bf16 safetensors shards with their index and an MTP head
(``layout.write_model``), and the tokenizer / processor files copied from the built-in tiny model (the same
Qwen3.5 tokenizer, ``layout.OFFICIAL_FILES``).  The weights are random (a forward's speed and memory do not
depend on their values) and built directly on the GPU, so the whole build is dominated by writing ~19 GB.

The folder is cached: ``checkpoint_dir(ckpt_dir)`` names it after a hash of the config, and a folder holding
the ``SERVE_BENCH_CHECKPOINT.json`` marker (written last) is reused as is.  Run it in its own process (the
benchmark does: ``python bench/serve_ckpt.py --ckpt-dir DIR``) so no GPU memory stays held afterwards.

    python bench/serve_ckpt.py --ckpt-dir ~/.cache/qwen_chat/serve_bench       # GPU host; prints the folder
    python bench/serve_ckpt.py --ckpt-dir /tmp/sb --smoke                       # small config on CPU
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = Path(__file__).with_name("qwen3_5_9b_config.json")
MARKER = "SERVE_BENCH_CHECKPOINT.json"
DEFAULT_CKPT_DIR = Path("~/.cache/qwen_chat/serve_bench")
SEED = 0


def load_config_dict(smoke: bool = False) -> dict:
    """The published config as a dict; ``smoke``: the same structure scaled down (hidden 64, 4 layers) so the
    build can be checked on a CPU in seconds."""
    raw = json.loads(CONFIG.read_text())
    if smoke:
        tc, vc = raw["text_config"], raw["vision_config"]
        tc.update(hidden_size=64, intermediate_size=192, num_hidden_layers=4, layer_types=tc["layer_types"][:4],
                  head_dim=64, linear_key_head_dim=16, linear_value_head_dim=16)
        tc["rope_parameters"]["mrope_section"] = [3, 3, 2]
        vc.update(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64)
    return raw


def checkpoint_dir(ckpt_dir: Path, smoke: bool = False) -> Path:
    """Folder of the checkpoint for the current config under ``ckpt_dir`` (it may not exist yet)."""
    digest = hashlib.sha256(json.dumps(load_config_dict(smoke), sort_keys=True).encode()).hexdigest()[:10]
    return Path(ckpt_dir).expanduser() / f"qwen3_5-{'smoke' if smoke else '9b'}-random-{digest}"


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished build (the marker is written after every other file)."""
    return (Path(folder) / MARKER).is_file() and (Path(folder) / "config.json").is_file()


def _tokenizer_files(cache_dir: Path) -> Path:
    """The built-in tiny model's folder (built once under ``cache_dir``): the source of the tokenizer files."""
    sys.path.insert(0, str(ROOT))
    from qwen_chat.engine.checkpoints.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(cache_dir)


def build_checkpoint(out: Path, *, device: str = "cuda", smoke: bool = False,
                     tiny_cache: Path = Path("~/.cache/qwen_chat")) -> dict:
    """Write the random bf16 checkpoint into ``out`` (atomically: a temp folder beside it, then a rename).

    Returns ``{"folder", "parameters", "build_s" (seconds, model on the device), "write_s" (seconds, shards on
    disk), "bytes"}``.  Raises whatever torch / transformers / safetensors raise (out of memory, disk full).
    """
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    sys.path.insert(0, str(ROOT))
    from qwen_chat.engine.checkpoints.layout import INDEX_FILE, OFFICIAL_FILES, write_model

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tiny = _tokenizer_files(Path(tiny_cache).expanduser())
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        t0 = time.monotonic()
        config = Qwen3_5Config.from_dict(load_config_dict(smoke))
        torch.manual_seed(SEED)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = Qwen3_5ForConditionalGeneration(config).eval()
        finally:
            torch.set_default_dtype(old)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        params = sum(p.numel() for p in model.parameters())
        t1 = time.monotonic()
        write_model(model, tmp, seed=SEED)
        t2 = time.monotonic()
        del model
        for name in OFFICIAL_FILES:
            if name not in ("config.json", INDEX_FILE):
                shutil.copy2(tiny / name, tmp / name)
        size = sum(f.stat().st_size for f in tmp.iterdir())
        info = {"parameters": params, "build_s": round(t1 - t0, 2), "write_s": round(t2 - t1, 2), "bytes": size,
                "config": str(CONFIG.relative_to(ROOT)), "smoke": smoke, "seed": SEED, "device": device}
        (tmp / MARKER).write_text(json.dumps(info, indent=2))
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp / safetensors create owner-only modes
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():
            shutil.rmtree(out)  # an unfinished earlier build (no marker)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"folder": str(out), **info}


def ensure_checkpoint(ckpt_dir: Path, *, device: str = "cuda", smoke: bool = False) -> tuple[Path, dict]:
    """The cached checkpoint folder under ``ckpt_dir``, built first when missing.  Returns (folder, info) where
    info is the marker's content plus ``"reused": bool``."""
    folder = checkpoint_dir(ckpt_dir, smoke)
    if is_complete(folder):
        return folder, {**json.loads((folder / MARKER).read_text()), "reused": True}
    info = build_checkpoint(folder, device=device, smoke=smoke)
    return folder, {**info, "reused": False}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt-dir", type=Path, default=DEFAULT_CKPT_DIR, help="cache folder of the checkpoint")
    ap.add_argument("--device", default=None, help="where the random weights are built (default: cuda, "
                                                   "cpu with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="scaled-down config (checks the build on a CPU)")
    ap.add_argument("--json", action="store_true", help="print the build info as one JSON line")
    args = ap.parse_args(argv)
    folder, info = ensure_checkpoint(args.ckpt_dir, device=args.device or ("cpu" if args.smoke else "cuda"),
                                     smoke=args.smoke)
    print(json.dumps({"folder": str(folder), **info}) if args.json else folder, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
