"""The built-in ``tiny`` demo checkpoint: real Qwen3.5 structure and tokenizer, small width, random weights.

``--model tiny`` lets the whole service (UI, API, engine, sharding) run on a CPU-only machine with no
download.  The checkpoint is written once to a cache folder and then loaded with the very same
``AutoProcessor.from_pretrained`` + ``Qwen3_5ForConditionalGeneration.from_pretrained`` code as a real one
(``qwen_chat.engine.checkpoints.loading``).  Its answers are gibberish; ``config.json`` carries
``"qwen_chat_demo": true`` (and the folder a ``QWEN_CHAT_DEMO`` marker file) so the UI can show a "demo model:
random weights" badge.

What is real (docs/facts.md, "Shape", and the published config, ``bench/qwen3_5_9b_config.json``): model_type
``qwen3_5``; the layer pattern 3 x Gated DeltaNet ``linear_attention`` + 1 x gated ``full_attention``; attention
output gate; partial rotary 0.25 with interleaved M-RoPE; 16 query / 4 KV heads; 16 key / 32 value linear heads;
conv1d width 4; vocab 248,320 with the real tokenizer and special ids; vision tower with patch 16, temporal
patch 2, 2x2 spatial merge and ``out_hidden_size`` = text hidden; Qwen3VLProcessor with
Qwen2VLImageProcessor; the folder layout of the published checkpoint (``qwen_chat.engine.checkpoints.layout``:
four weight shards with an index, the ``mtp.`` head, ``vocab.json``/``merges.txt``, ``chat_template.jinja``,
both preprocessor configs, no ``generation_config.json``).  What is small: hidden 64, 4 text layers, head dims
64 (attention) / 16 (linear), vision depth 2 x hidden 64.  Weights are stored in bf16 like the real checkpoint
(about 66 MB of shards, dominated by the 248,320 x 64 input embedding and LM head).

Run ``python -m qwen_chat.engine.checkpoints.tiny [CACHE_DIR]`` to build it and print its path.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from qwen_chat.engine.checkpoints.folders import (TINY_MODEL_VERSION, tiny_checkpoint_dir,  # noqa: F401 - re-exported
                                                  tiny_is_complete)
from qwen_chat.engine.checkpoints.layout import write_model
from qwen_chat.engine.text.tokenizer_build import build_qwen35_tokenizer
from qwen_chat.pending import DEMO_MARKER

#: Marker key in config.json and marker file name in the checkpoint folder.
DEMO_CONFIG_KEY = "qwen_chat_demo"
DEMO_MARKER_FILE = DEMO_MARKER  # the web layer reads it before the engine loads (qwen_chat.pending)

#: Seed of the random weights (fixed: two builds give identical tensors).
TINY_SEED = 20260301

#: Weight shards of the tiny checkpoint: as many as the published Qwen3.5-9B has.
TINY_SHARDS = 4

TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "text" / "chat_template.jinja"

# Image processor settings of the Qwen3.5 checkpoints (Qwen3-VL family): 16 px patches, 2x2 merge,
# mean/std 0.5, pixel range 65,536 .. 16,777,216 (64 .. 16,384 visual tokens of 32x32 px).
PREPROCESSOR_SETTINGS = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)

# Video processor of the Qwen3.5 checkpoints (only loaded where torchvision is installed; the service sends
# no video).
VIDEO_PREPROCESSOR_CONFIG = dict(
    video_processor_type="Qwen3VLVideoProcessor",
    processor_class="Qwen3VLProcessor",
    **{**PREPROCESSOR_SETTINGS, "size": {"shortest_edge": 4096, "longest_edge": 25165824}},
)


def tiny_config() -> Qwen3_5Config:
    """Return the tiny model's ``Qwen3_5Config`` (text hidden 64, 4 layers, vision depth 2).

    Ratios kept from the real 9B config: q heads / KV heads = 16 / 4 (TP degrees 1, 2, 4 divide it),
    linear key / value heads = 16 / 32, MLP = 3 x hidden, rotary dims = 25 % of head_dim with the M-RoPE
    sections [11, 11, 10] scaled to [3, 3, 2] (sum = rotary_dim / 2 = 64 * 0.25 / 2).
    """
    text_config = {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 192,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 16,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    }
    vision_config = {
        "model_type": "qwen3_5",
        "deepstack_visual_indexes": [],
        "depth": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "in_channels": 3,
        "intermediate_size": 128,
        "num_heads": 4,
        "num_position_embeddings": 2304,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=248056,
        video_token_id=248057,
        vision_start_token_id=248053,
        vision_end_token_id=248054,
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForConditionalGeneration"],
    )


def _update_json(path: Path, updates: dict) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def _write_checkpoint(out: Path) -> None:
    """Write every file of the tiny checkpoint, in the published layout (``layout.OFFICIAL_FILES`` plus four
    weight shards and the demo marker), into the existing empty folder ``out``."""
    config = tiny_config()
    torch.manual_seed(TINY_SEED)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    # Stored in bf16 like the real checkpoint; loading.py picks fp32 on CPU.
    model.to(torch.bfloat16)
    write_model(model, out, seed=TINY_SEED, num_shards=TINY_SHARDS)
    # Mark the checkpoint as a demo in config.json (loaded back as a config attribute) and by a file.
    _update_json(out / "config.json", {DEMO_CONFIG_KEY: True})

    # tokenizer.json, tokenizer_config.json and chat_template.jinja (read by AutoTokenizer and AutoProcessor),
    # then vocab.json + merges.txt of the same BPE model, as the published folder has them.
    tokenizer = build_qwen35_tokenizer()
    tokenizer.chat_template = TEMPLATE_PATH.read_text()
    tokenizer.save_pretrained(out)
    tokenizer.backend_tokenizer.model.save(str(out))
    # Processor files written as plain JSON: building a Qwen3VLProcessor object here would need its video
    # processor, i.e. torchvision, which has no CPU wheel on PyPI (see loading.load_processor).  The
    # published folder has no processor_config.json: preprocessor_config.json names the processor class.
    image_processor = Qwen2VLImageProcessorPil(**PREPROCESSOR_SETTINGS)
    image_processor.save_pretrained(out)
    _update_json(out / "preprocessor_config.json", {"processor_class": "Qwen3VLProcessor",
                                                    "image_processor_type": "Qwen2VLImageProcessor"})
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2))
    # No generation_config.json, like the published folder may be: the model card's presets apply.
    (out / DEMO_MARKER_FILE).write_text(
        f"qwen_chat built-in tiny model v{TINY_MODEL_VERSION}: random weights, answers are gibberish.\n")


def build_tiny_checkpoint(cache_dir: Path) -> Path:
    """Build (once) and return the folder of the tiny demo checkpoint under ``cache_dir``.

    Idempotent: an existing complete folder for ``TINY_MODEL_VERSION`` is returned as is.  Atomic: files are
    written into a temporary folder beside the target and moved into place with ``os.replace``, so a crash or
    two concurrent builders (several ranks) never leave a half-written checkpoint; the loser of a race
    discards its copy.  Takes about 15-25 s on 2 CPU cores (the tokenizer conversion dominates).

    Raises:
        OSError: if ``cache_dir`` cannot be created or written.
    """
    cache_dir = Path(cache_dir).expanduser()
    target = tiny_checkpoint_dir(cache_dir)
    if tiny_is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
    try:
        _write_checkpoint(tmp)
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp/safetensors create owner-only modes
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists() and not tiny_is_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # leftover of an old, interrupted non-atomic copy
        try:
            os.replace(tmp, target)
        except OSError:
            if not tiny_is_complete(target):  # not a lost race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("~/.cache/qwen_chat").expanduser()
    print(build_tiny_checkpoint(where))
