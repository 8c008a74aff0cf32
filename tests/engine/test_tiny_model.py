"""The built-in tiny checkpoint and loading: real Qwen3.5 structure, same from_pretrained path as a real
checkpoint, demo marker, atomic/idempotent build, --model resolution, kernel report."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from qwen_chat.chat_types import ChatMessage
from qwen_chat.engine.checkpoints.loading import (
    LoadedModel,
    ModelUnavailable,
    describe_kernels,
    is_demo_checkpoint,
    resolve_checkpoint,
)
from qwen_chat.engine.text.prompt import build_prompt
from qwen_chat.engine.checkpoints.tiny import TINY_MODEL_VERSION, build_tiny_checkpoint, tiny_config

#: The published Qwen3.5-9B config.json, kept in the repository as data (docs/facts.md).
REAL_CONFIG = Path(__file__).resolve().parents[2] / "bench" / "qwen3_5_9b_config.json"


def test_config_has_real_structure():
    config = tiny_config()
    text, vision = config.text_config, config.vision_config
    assert config.model_type == "qwen3_5"
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert text.attn_output_gate is True
    assert text.vocab_size == 248320
    assert (text.num_attention_heads, text.num_key_value_heads) == (16, 4)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 32)
    assert text.linear_conv_kernel_dim == 4
    rope = text.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_interleaved"] is True
    # M-RoPE sections cover the rotary half-dimension: sum == head_dim * 0.25 / 2.
    assert sum(rope["mrope_section"]) == text.head_dim * rope["partial_rotary_factor"] / 2
    assert (config.image_token_id, config.video_token_id) == (248056, 248057)
    assert (config.vision_start_token_id, config.vision_end_token_id) == (248053, 248054)
    assert text.eos_token_id == 248044
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (16, 2, 2)
    assert vision.out_hidden_size == text.hidden_size
    assert vision.depth == 2


def test_config_keys_match_real_config():
    real = json.loads(REAL_CONFIG.read_text())
    tiny = tiny_config().to_dict()
    assert set(real["text_config"]) - {"mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"} <= set(
        tiny["text_config"]) | {"full_attention_interval", "mamba_ssm_dtype"}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert tiny[key] == real[key]


def test_checkpoint_files_and_size(tiny_checkpoint):
    names = {p.name for p in tiny_checkpoint.iterdir()}
    for required in ("config.json", "model.safetensors.index.json", "model-00001-of-00004.safetensors",
                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        assert required in names
    assert "generation_config.json" not in names  # the published folder may lack it (both load)
    assert tiny_checkpoint.name.endswith(f"v{TINY_MODEL_VERSION}")
    total_mb = sum(p.stat().st_size for p in tiny_checkpoint.iterdir()) / 2**20
    assert total_mb < 150
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["qwen_chat_demo"] is True
    assert is_demo_checkpoint(tiny_checkpoint)
    pre = json.loads((tiny_checkpoint / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor" and pre["processor_class"] == "Qwen3VLProcessor"
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)


def test_build_is_idempotent(tiny_checkpoint):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_checkpoint.iterdir()}
    again = build_tiny_checkpoint(tiny_checkpoint.parent)
    assert again == tiny_checkpoint
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before
    # No temporary build folders are left behind.
    assert [p.name for p in tiny_checkpoint.parent.iterdir() if ".tmp-" in p.name] == []


def test_loaded_model(tiny_loaded):
    assert isinstance(tiny_loaded, LoadedModel)
    model = tiny_loaded.model
    assert isinstance(model, Qwen3_5ForConditionalGeneration)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert tiny_loaded.info.demo is True
    assert tiny_loaded.info.context_length == 262144
    assert "demo" in tiny_loaded.info.name
    assert tiny_loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") == 248046
    image_processor = tiny_loaded.processor.image_processor
    assert (image_processor.patch_size, image_processor.merge_size) == (16, 2)
    assert tiny_loaded.checkpoint.is_dir()


def test_forward_and_greedy_generation_are_deterministic(tiny_loaded):
    tok = tiny_loaded.tokenizer
    ids = tok("Hello, tiny model", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = tiny_loaded.model(input_ids=ids).logits
        assert logits.shape == (1, ids.shape[1], 248320)
        assert torch.isfinite(logits).all()
        first = tiny_loaded.model.generate(ids, max_new_tokens=6, do_sample=False)
        second = tiny_loaded.model.generate(ids, max_new_tokens=6, do_sample=False)
    assert first.shape == (1, ids.shape[1] + 6)
    assert torch.equal(first, second)


def test_image_prompt_forward(tiny_loaded, tmp_path):
    image = "tests/fixtures/images/chelsea.png"
    prompt = build_prompt(tiny_loaded, [ChatMessage("user", "What animal is this?", images=(image,))],
                          enable_thinking=False, image_token_budget=64, context_length=4096,
                          max_new_tokens=64)
    with torch.no_grad():
        out = tiny_loaded.model(input_ids=prompt.input_ids[None], pixel_values=prompt.pixel_values,
                                image_grid_thw=prompt.image_grid_thw,
                                mm_token_type_ids=prompt.mm_token_type_ids[None])
    assert out.logits.shape == (1, prompt.num_tokens, 248320)
    assert torch.isfinite(out.logits).all()


def test_resolve_tiny_and_local_folder(tiny_checkpoint):
    assert resolve_checkpoint("tiny", tiny_checkpoint.parent) == tiny_checkpoint
    assert resolve_checkpoint(str(tiny_checkpoint)) == tiny_checkpoint.resolve()


def test_resolve_folder_without_config(tmp_path):
    with pytest.raises(ModelUnavailable) as info:
        resolve_checkpoint(str(tmp_path))
    assert "--model PATH" in str(info.value) and "--model tiny" in str(info.value)


def test_resolve_missing_path(tmp_path):
    with pytest.raises(ModelUnavailable) as info:
        resolve_checkpoint(str(tmp_path / "nope" / "model"))
    assert "--model tiny" in str(info.value)


def test_resolve_hub_id_offline_not_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelUnavailable) as info:
        resolve_checkpoint("Qwen/Qwen3.5-9B")
    message = str(info.value)
    assert "Qwen/Qwen3.5-9B" in message and "--model PATH" in message and "--model tiny" in message


def test_describe_kernels_reports_each_op():
    kernels = describe_kernels()
    assert set(kernels) == {"chunked delta rule (prefill)", "recurrent delta rule (decode)",
                            "causal conv1d (prefill)", "causal conv1d update (decode)"}
    has_fla = importlib.util.find_spec("fla") is not None
    has_conv = importlib.util.find_spec("causal_conv1d") is not None
    for op, impl in kernels.items():
        package_installed = has_fla if "delta rule" in op else has_conv
        if package_installed:
            assert impl.startswith(("fla", "causal_conv1d")), (op, impl)
        else:
            assert impl == "torch fallback", (op, impl)


ZERO3_CHILD = r"""
import os, socket, sys
from pathlib import Path
import torch
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from transformers.integrations import HfDeepSpeedConfig
from qwen_chat.engine.checkpoints.loading import load_model
deepspeed.init_distributed(dist_backend="gloo")
config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "train_micro_batch_size_per_gpu": 1}
keep_alive = HfDeepSpeedConfig(config)
loaded = load_model(Path(sys.argv[1]), "cpu", torch.float32, place_on_device=False)
param = loaded.model.model.language_model.embed_tokens.weight
print("PARTITIONED", hasattr(param, "ds_id"), tuple(param.shape), loaded.info.demo)
module = deepspeed.initialize(model=loaded.model, config=config)[0].module.eval()
ids = loaded.tokenizer("hello world", return_tensors="pt").input_ids
with torch.no_grad():
    print("LOGITS", tuple(module(input_ids=ids).logits.shape))
"""


@pytest.mark.slow  # spawns a DeepSpeed process (import + gloo init + ZeRO-3 load): 30-60 s on 2 cores
def test_load_model_under_zero3_config(tiny_checkpoint):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", ZERO3_CHILD, str(tiny_checkpoint)], capture_output=True,
                            text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    # Weights were partitioned by ZeRO-3 while loading (empty local tensors), and the model still runs.
    assert "PARTITIONED True (0,) True" in result.stdout
    assert "LOGITS (1, 2, 248320)" in result.stdout


def _fake_writer(out):
    (out / "config.json").write_text("{}")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "QWEN_CHAT_DEMO").write_text("demo\n")


def test_build_replaces_an_incomplete_folder(tmp_path, monkeypatch):
    from qwen_chat.engine.checkpoints import tiny

    monkeypatch.setattr(tiny, "_write_checkpoint", _fake_writer)
    target = tiny.tiny_checkpoint_dir(tmp_path)
    target.mkdir()
    (target / "config.json").write_text("{}")  # interrupted old copy: no marker file
    assert tiny.build_tiny_checkpoint(tmp_path) == target
    assert (target / "QWEN_CHAT_DEMO").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_build_replaces_a_folder_of_the_old_layout(tmp_path, monkeypatch):
    """A folder with config.json and the marker but no weight index (the single-file layout) is rebuilt."""
    from qwen_chat.engine.checkpoints import tiny

    monkeypatch.setattr(tiny, "_write_checkpoint", _fake_writer)
    target = tiny.tiny_checkpoint_dir(tmp_path)
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "QWEN_CHAT_DEMO").write_text("demo\n")
    (target / "model.safetensors").write_text("old")
    assert tiny.build_tiny_checkpoint(tmp_path) == target
    assert sorted(p.name for p in target.iterdir()) == ["QWEN_CHAT_DEMO", "config.json",
                                                        "model.safetensors.index.json"]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    from qwen_chat.engine.checkpoints import tiny

    def broken(out):
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(tiny, "_write_checkpoint", broken)
    with pytest.raises(OSError, match="disk full"):
        tiny.build_tiny_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_build_that_loses_a_race_returns_the_winner(tmp_path, monkeypatch):
    from qwen_chat.engine.checkpoints import tiny

    target = tiny.tiny_checkpoint_dir(tmp_path)

    def racing(out):  # another rank finishes first while this one is still writing
        _fake_writer(out)
        target.mkdir()
        _fake_writer(target)
        (target / "winner").write_text("1")

    monkeypatch.setattr(tiny, "_write_checkpoint", racing)
    assert tiny.build_tiny_checkpoint(tmp_path) == target
    assert (target / "winner").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_display_name_of_hub_snapshot_and_local_folder(tmp_path):
    from qwen_chat.engine.checkpoints.loading import display_name

    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3.5-9B" / "snapshots" / "0123abcd"
    assert display_name(snapshot) == "Qwen/Qwen3.5-9B"
    assert display_name(tmp_path / "my-checkpoint") == "my-checkpoint"
