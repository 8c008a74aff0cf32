"""The published checkpoint layout: the tiny folder's files and tensor names, the loading variants that must load
and the broken folders that must be refused with one line naming the file (in-process and as app.py's exit 78).

Variants are copies of the session's tiny checkpoint in tmp_path made of symlinks; a file that a variant changes
is unlinked first and written anew, so the shared checkpoint is never modified.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration

from qwen_chat.config import ServiceConfig
from qwen_chat.engine.checkpoints import layout
from qwen_chat.engine.checkpoints.layout import INDEX_FILE, OFFICIAL_FILES, CheckpointError, inspect_checkpoint
from qwen_chat.engine.checkpoints.loading import load_model
from qwen_chat.engine.checkpoints.tiny import DEMO_MARKER_FILE, TINY_SHARDS
from tests.support.small_model import small_model
from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[2]

#: The multi-token-prediction head: 4 tensors + one full-attention decoder layer (11).
MTP_NAMES = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
             "mtp.norm.weight"} | {f"mtp.layers.0.{n}.weight" for n in (
                 "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")}

#: Special ids the service relies on (docs/facts.md, "Tokens").
FACT_IDS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|image_pad|>": 248056,
            "<think>": 248068, "</think>": 248069}


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX_FILE).read_text())["weight_map"]


def variant(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` made of symlinks (change files only through ``rewrite``)."""
    dst.mkdir()
    for f in src.iterdir():
        os.symlink(f, dst / f.name)
    return dst


def rewrite(path: Path, data) -> None:
    """Replace ``path`` (usually a symlink into the shared checkpoint) by a new file: JSON, text, bytes or
    tensors."""
    if path.is_symlink() or path.exists():
        path.unlink()
    if isinstance(data, dict) and data and all(isinstance(v, torch.Tensor) for v in data.values()):
        save_file(data, str(path), metadata={"format": "pt"})
    elif isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else json.dumps(data))


def last_logits(loaded) -> torch.Tensor:
    ids = loaded.tokenizer("The official layout loads", return_tensors="pt").input_ids
    with torch.no_grad():
        return loaded.model(input_ids=ids).logits[0, -1]


# --- the tiny folder is in the published layout -------------------------------------------------------------

def test_tiny_folder_has_the_official_file_list(tiny_checkpoint):
    shards = [f"model-{k:05d}-of-{TINY_SHARDS:05d}.safetensors" for k in range(1, TINY_SHARDS + 1)]
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert names == set(OFFICIAL_FILES) | set(shards) | {DEMO_MARKER_FILE}
    assert sorted(set(weight_map(tiny_checkpoint).values())) == shards
    index = json.loads((tiny_checkpoint / INDEX_FILE).read_text())
    sizes = sum(p.stat().st_size for p in tiny_checkpoint.glob("model-*.safetensors"))
    assert 0 < index["metadata"]["total_size"] < sizes  # data bytes, without the shards' headers
    # chat_template.jinja is its own file (not a tokenizer_config.json field).
    assert "<|im_start|>" in (tiny_checkpoint / "chat_template.jinja").read_text()
    assert "chat_template" not in json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())


def test_tiny_tensor_names_are_the_published_ones(tiny_checkpoint):
    names = set(weight_map(tiny_checkpoint))
    assert {n for n in names if n.startswith("mtp.")} == MTP_NAMES
    assert "lm_head.weight" in names
    assert all(n == "lm_head.weight" or n.startswith(("model.language_model.", "model.visual.", "mtp."))
               for n in names)
    visual = {n.split(".")[2] for n in names if n.startswith("model.visual.")}
    assert visual == {"patch_embed", "pos_embed", "blocks", "merger"}
    assert {"model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
            "model.language_model.layers.0.linear_attn.A_log",
            "model.language_model.layers.3.self_attn.q_proj.weight"} <= names
    report = inspect_checkpoint(tiny_checkpoint)
    assert report.mtp_tensors == 15 and report.generation_config is False
    assert {dtype for dtype, _ in report.tensors.values()} == {"BF16"}
    # The MTP layer is shaped like the model's full-attention layer 3 (q_proj includes the output gate).
    assert report.tensors["mtp.layers.0.self_attn.q_proj.weight"][1] == \
        report.tensors["model.language_model.layers.3.self_attn.q_proj.weight"][1]
    assert report.tensors["mtp.fc.weight"][1] == (64, 128)


def test_written_names_are_what_transformers_saves_and_loads(tmp_path):
    """Outside mtp.*, the layout's names are exactly save_pretrained's, and from_pretrained loads them back
    with nothing missing or unexpected (mtp.* is ignored without a warning)."""
    model = small_model()
    model.save_pretrained(tmp_path / "hf", max_shard_size="500KB")  # sharded, with an index
    written = tmp_path / "ours"
    written.mkdir()
    shards = layout.write_model(model, written, seed=1, num_shards=3)
    assert len(shards) == 3
    hf_names = set(weight_map(tmp_path / "hf"))
    ours = set(weight_map(written))
    assert ours - hf_names == {n for n in ours if n.startswith("mtp.")} and hf_names <= ours
    loaded, info = Qwen3_5ForConditionalGeneration.from_pretrained(written, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_tiny_tokenizer_files_and_special_ids(tiny_checkpoint, tiny_loaded):
    tok = tiny_loaded.tokenizer
    for text, token_id in FACT_IDS.items():
        assert tok.convert_tokens_to_ids(text) == token_id, text
    vocab = json.loads((tiny_checkpoint / "vocab.json").read_text())
    assert len(vocab) == 248044  # the BPE tokens; the specials live in tokenizer.json's added_tokens
    sample = tok.convert_ids_to_tokens([0, 1000, 150000, 248043])
    assert [vocab[t] for t in sample] == [0, 1000, 150000, 248043]
    merges = (tiny_checkpoint / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version") and len(merges) > 200000


def test_tiny_preprocessor_configs(tiny_checkpoint, tiny_loaded):
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        pre = json.loads((tiny_checkpoint / name).read_text())
        assert (pre["patch_size"], pre["temporal_patch_size"], pre["merge_size"]) == (16, 2, 2), name
        assert pre["image_mean"] == [0.5] * 3 and pre["image_std"] == [0.5] * 3, name
        assert pre["processor_class"] == "Qwen3VLProcessor"
    image = json.loads((tiny_checkpoint / "preprocessor_config.json").read_text())
    assert image["size"] == {"longest_edge": 16777216, "shortest_edge": 65536}
    assert tiny_loaded.processor.image_processor.size["longest_edge"] == 16777216


# --- variants that load ----------------------------------------------------------------------------------------

def test_f32_a_log_and_norms_load_to_the_same_model(tiny_checkpoint, tiny_loaded, tmp_path):
    folder = variant(tiny_checkpoint, tmp_path / "f32")
    f32 = re.compile(r"(A_log|norm[^.]*\.weight|dt_bias)$")
    changed = 0
    for shard in sorted(set(weight_map(folder).values())):
        tensors = load_file(str(tiny_checkpoint / shard))
        if any(f32.search(n) for n in tensors):
            changed += sum(bool(f32.search(n)) for n in tensors)
            rewrite(folder / shard, {n: t.float() if f32.search(n) else t for n, t in tensors.items()})
    report = inspect_checkpoint(folder)
    assert changed > 10 and sum(d == "F32" for d, _ in report.tensors.values()) == changed
    loaded = load_model(folder, "cpu", torch.float32)
    assert torch.equal(last_logits(loaded), last_logits(tiny_loaded))


def test_generation_config_and_extra_mtp_tensors_load_without_warnings(tiny_checkpoint, tiny_loaded, tmp_path,
                                                                       caplog):
    folder = variant(tiny_checkpoint, tmp_path / "extra")
    rewrite(folder / "generation_config.json", {"eos_token_id": [248046, 248044], "temperature": 1.0})
    extra = {f"mtp.layers.1.mlp.{n}.weight": torch.zeros(8, 64, dtype=torch.bfloat16) for n in ("up", "gate")}
    rewrite(folder / "model-mtp-extra.safetensors", extra)
    index = json.loads((tiny_checkpoint / INDEX_FILE).read_text())
    index["weight_map"].update({n: "model-mtp-extra.safetensors" for n in extra})
    rewrite(folder / INDEX_FILE, index)
    report = inspect_checkpoint(folder)
    assert report.mtp_tensors == 17 and report.generation_config and len(report.shards) == TINY_SHARDS + 1
    with caplog.at_level(logging.WARNING):
        loaded = load_model(folder, "cpu", torch.float32)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "mtp" in r.getMessage()]
    assert torch.equal(last_logits(loaded), last_logits(tiny_loaded))


def test_a_single_weights_file_without_index_loads(tiny_checkpoint, tiny_loaded, tmp_path):
    folder = variant(tiny_checkpoint, tmp_path / "single")
    tensors = {}
    for shard in sorted(set(weight_map(folder).values())):
        tensors.update(load_file(str(tiny_checkpoint / shard)))
        (folder / shard).unlink()
    (folder / INDEX_FILE).unlink()
    rewrite(folder / "model.safetensors", tensors)
    assert inspect_checkpoint(folder).shards == ("model.safetensors",)
    assert torch.equal(last_logits(load_model(folder, "cpu", torch.float32)), last_logits(tiny_loaded))


# --- broken folders: one line naming the file -----------------------------------------------------------------

def _missing_shard(folder: Path) -> str:
    (folder / "model-00003-of-00004.safetensors").unlink()
    return "model-00003-of-00004.safetensors: weight shard is missing"


def _foreign_model_type(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    rewrite(folder / "config.json", {**config, "model_type": "qwen3_5_moe"})
    return "config.json: model_type 'qwen3_5_moe' is not a Qwen3.5 checkpoint"


def _bitsandbytes_config(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    rewrite(folder / "config.json", {**config, "quantization_config": {"quant_method": "bitsandbytes", "bits": 4}})
    return "config.json: quantization_config quant_method 'bitsandbytes' is not supported (only 'fp8'"


def _index_names_absent_tensor(folder: Path) -> str:
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.language_model.extra.weight"] = "model-00004-of-00004.safetensors"
    rewrite(folder / INDEX_FILE, index)
    return "model-00004-of-00004.safetensors: lacks 1 tensor(s)"


def _not_safetensors(folder: Path) -> str:
    rewrite(folder / "model-00004-of-00004.safetensors", "not safetensors")
    return "model-00004-of-00004.safetensors: not a safetensors file"


def _truncated_shard(folder: Path) -> str:
    """A copy or download cut short: the header is intact, the tensor data is not all there."""
    path = folder / "model-00002-of-00004.safetensors"
    rewrite(path, path.read_bytes()[:path.stat().st_size // 2])
    return "model-00002-of-00004.safetensors: weight shard is truncated"


def _weight_left_out(folder: Path) -> str:
    shard = weight_map(folder)["model.language_model.norm.weight"]
    tensors = load_file(str(folder / shard))
    del tensors["model.language_model.norm.weight"]
    rewrite(folder / shard, tensors)
    index = json.loads((folder / INDEX_FILE).read_text())
    del index["weight_map"]["model.language_model.norm.weight"]
    rewrite(folder / INDEX_FILE, index)
    return "the checkpoint lacks 1 weight(s) of Qwen3.5, e.g. model.language_model.norm.weight"


def _swapped_special_ids(folder: Path) -> str:
    data = json.loads((folder / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:  # <|im_start|> and <|im_end|> trade ids
        entry["content"] = {"<|im_start|>": "<|im_end|>", "<|im_end|>": "<|im_start|>"}.get(entry["content"],
                                                                                           entry["content"])
    rewrite(folder / "tokenizer.json", data)
    return "tokenizer.json: special token '<|im_start|>' has id 248046, expected 248045"


BROKEN = [_missing_shard, _foreign_model_type, _bitsandbytes_config, _index_names_absent_tensor, _not_safetensors,
          _truncated_shard,
          _weight_left_out, _swapped_special_ids]


@pytest.mark.parametrize("breakage", BROKEN, ids=lambda f: f.__name__.strip("_"))
def test_broken_folder_is_refused_with_one_line(tiny_checkpoint, tmp_path, breakage):
    folder = variant(tiny_checkpoint, tmp_path / "broken")
    expected = breakage(folder)
    with pytest.raises(CheckpointError) as info:
        load_model(folder, "cpu", torch.float32)
    message = str(info.value)
    assert expected in message and "\n" not in message, message
    assert str(folder) in message


def test_start_engine_turns_a_refusal_into_one_startup_line(tiny_checkpoint, tmp_path):
    from qwen_chat.engine.startup import bootstrap

    folder = variant(tiny_checkpoint, tmp_path / "foreign")
    expected = _foreign_model_type(folder)
    cfg = ServiceConfig(model=str(folder), device="cpu", history_dir=tmp_path / "h")
    with pytest.raises(bootstrap.StartupError) as info:
        bootstrap.start_engine(cfg)
    message = str(info.value)
    assert message.startswith(str(folder.resolve() / "config.json")) and expected in message
    assert "\n" not in message and "rank 0" not in message


@pytest.mark.slow  # app.py in a subprocess: imports torch/transformers (~10 s)
def test_app_exits_78_naming_the_missing_shard(tiny_checkpoint, tmp_path):
    folder = variant(tiny_checkpoint, tmp_path / "missing")
    expected = _missing_shard(folder)
    out = subprocess.run([sys.executable, "app.py", "--model", str(folder), "--device", "cpu", "--port",
                          str(free_port()), "--history-dir", str(tmp_path / "h")], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 78, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("app.py: cannot start the engine: ")]
    assert len(lines) == 1 and expected in lines[0], out.stderr[-2000:]
