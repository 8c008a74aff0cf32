"""LoRA adapters (``--adapter``): an adapter made with peft on the tiny model, merged by the engine, gives the
logits of peft's unmerged forward (the engine's ModelRunner prefill, fp32, relative error <= 1e-4); wrong
adapters are refused with one line naming the mismatch; ``/v1/models`` shows the adapter."""
from __future__ import annotations

import json
import os
from pathlib import Path

import peft
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration

from qwen_chat.config import ConfigError, ServiceConfig
from qwen_chat.engine.checkpoints.adapters import (AdapterError, describe_merge, merge_adapter, read_adapter,
                                                   resolve_modules)
from qwen_chat.engine.checkpoints.loading import load_model
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PreparedPrompt
from tests.support.fake_backend import FakeBackend
from tests.support.servers import api_app
from tests.support.small_model import TOL, rel_err, tiny_prompts

GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.fixture(scope="module")
def prompts(tiny_loaded) -> dict[str, PreparedPrompt]:
    """A text prompt and an image prompt for the tiny model."""
    return tiny_prompts(tiny_loaded, "A LoRA fine-tune of Qwen3.5")


def weights(checkpoint: Path):
    """A fresh fp32 copy of the tiny model's weights (no processor)."""
    return Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@torch.no_grad()
def forward_last(model, prompt: PreparedPrompt) -> torch.Tensor:
    """The transformers (or peft) model's logits at the prompt's last position, fp32 [vocab]."""
    kw = {}
    if prompt.pixel_values is not None:
        kw = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                  mm_token_type_ids=prompt.mm_token_type_ids[None])
    return model(input_ids=prompt.input_ids[None], **kw).logits[0, -1]


def make_adapter(checkpoint: Path, out: Path, config, seed: int, prompts: dict) -> dict[str, torch.Tensor]:
    """Wrap a fresh tiny model in peft with ``config``, give every LoRA factor random N(0, 0.05) values (B too,
    so the merge matters), save the adapter to ``out`` and return peft's unmerged logits per prompt."""
    model = peft.get_peft_model(weights(checkpoint), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return {name: forward_last(model, prompt) for name, prompt in prompts.items()}


def merged_runner_logits(checkpoint: Path, adapter_dir: Path, prompts: dict):
    """Load the tiny model as the service does, merge the adapter, prefill each prompt in a ModelRunner."""
    loaded = load_model(checkpoint, "cpu", torch.float32)
    adapter = read_adapter(adapter_dir)
    merged = merge_adapter(loaded.model, adapter)
    runner = ModelRunner(loaded.model, num_slots=2, max_context=512, device="cpu")
    logits = {name: runner.prefill(slot, prompt) for slot, (name, prompt) in enumerate(prompts.items())}
    return logits, merged, adapter


@pytest.fixture(scope="module")
def all_linear(tiny_checkpoint, tmp_path_factory, prompts):
    """An adapter on every linear layer (peft's "all-linear": text incl. linear_attn, and the vision tower)."""
    out = tmp_path_factory.mktemp("lora_all_linear")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return out, make_adapter(tiny_checkpoint, out, config, seed=1, prompts=prompts)


def test_merged_engine_matches_peft_unmerged_forward(tiny_checkpoint, tiny_loaded, all_linear, prompts):
    adapter_dir, refs = all_linear
    logits, merged, adapter = merged_runner_logits(tiny_checkpoint, adapter_dir, prompts)
    for name, prompt in prompts.items():
        assert rel_err(logits[name], refs[name]) <= TOL, name
        assert rel_err(forward_last(tiny_loaded.model, prompt), refs[name]) > 1e-2, name  # the merge matters
    for layer in range(3):  # every Gated DeltaNet projection of every linear-attention layer
        for proj in GDN:
            assert f"model.language_model.layers.{layer}.linear_attn.{proj}" in merged
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.language_model.layers.3.self_attn.{proj}" in merged
    assert sum(".mlp." in n and "language_model" in n for n in merged) == 4 * 3
    assert any(n.startswith("model.visual.") for n in merged)
    assert len(merged) == len(adapter.pairs) == 41
    line = describe_merge(adapter, merged)
    assert line.startswith(f"adapter {adapter_dir.name}: merged 41 modules (r=4, lora_alpha=8)")
    assert "model.language_model.layers.N.linear_attn.in_proj_a x3" in line


def test_rslora_rank_and_alpha_patterns_match_peft(tiny_checkpoint, tmp_path, prompts):
    config = peft.LoraConfig(r=8, lora_alpha=4, use_rslora=True, init_lora_weights=False,
                             target_modules=[*GDN, "o_proj", "down_proj"],
                             rank_pattern={"in_proj_qkv": 2, "layers.3.mlp.down_proj": 3},
                             alpha_pattern={"out_proj": 16})
    refs = make_adapter(tiny_checkpoint, tmp_path / "rslora", config, seed=2, prompts=prompts)
    logits, merged, adapter = merged_runner_logits(tiny_checkpoint, tmp_path / "rslora", prompts)
    assert adapter.rank_and_alpha("model.language_model.layers.3.mlp.down_proj") == (3, 4.0)
    assert adapter.rank_and_alpha("model.language_model.layers.0.linear_attn.out_proj") == (8, 16.0)
    assert len(merged) == 3 * 5 + 1 + 4
    for name in ("text", "image"):
        assert rel_err(logits[name], refs[name]) <= TOL, name


def test_text_only_names_and_fan_in_fan_out_merge_the_same(tiny_checkpoint, all_linear, tmp_path):
    """An adapter trained on Qwen3_5ForCausalLM names ``model.layers.N...``; ``fan_in_fan_out`` is off for
    nn.Linear in peft: both merge to the same weights as the original adapter."""
    adapter_dir, _ = all_linear
    variant = tmp_path / "text_only"
    variant.mkdir()
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    renamed = {k.replace("model.language_model.layers.", "model.layers."): v for k, v in tensors.items()
               if ".visual." not in k}
    save_file(renamed, str(variant / "adapter_model.safetensors"))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (variant / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    a, b = weights(tiny_checkpoint), weights(tiny_checkpoint)
    merge_adapter(a, read_adapter(adapter_dir))
    merged = merge_adapter(b, read_adapter(variant))
    assert merged and all(n.startswith("model.language_model.layers.") for n in merged)
    sa, sb = a.state_dict(), b.state_dict()
    for name in merged:
        assert torch.equal(sa[name + ".weight"], sb[name + ".weight"]), name


# --- wrong adapters -------------------------------------------------------------------------------------------

def write_adapter(folder: Path, tensors: dict, **config) -> Path:
    folder.mkdir()
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["up_proj"], "bias": "none",
            "base_model_name_or_path": "other/model"}
    (folder / "adapter_config.json").write_text(json.dumps({**base, **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def pair(module: str, out_features: int, in_features: int, r: int = 2) -> dict[str, torch.Tensor]:
    key = f"base_model.model.{module}"
    return {f"{key}.lora_A.weight": torch.ones(r, in_features), f"{key}.lora_B.weight": torch.ones(out_features, r)}


UP = "model.language_model.layers.0.mlp.up_proj"  # 192 x 64 in the tiny model

WRONG = {
    "other_hidden_size": (pair(UP, 192, 4096), {}, f"{UP} is 192 x 4096 (out x in) in the adapter but 192 x 64"),
    "missing_module": (pair("model.language_model.layers.9.mlp.up_proj", 192, 64), {},
                       "module model.language_model.layers.9.mlp.up_proj does not exist in the base model"),
    "not_linear": (pair("model.language_model.layers.0.linear_attn.conv1d", 192, 64), {},
                   "linear_attn.conv1d is a Conv1d, only nn.Linear layers can be merged"),
    "not_linear_target_name": (pair(UP, 192, 64), {"target_modules": ["up_proj", "conv1d"]},
                               "target module 'conv1d' is a Conv1d in the base model; only nn.Linear layers"),
    "unknown_target_name": (pair(UP, 192, 64), {"target_modules": ["up_proj", "in_proj_ba"]},
                            "target module 'in_proj_ba' matches no module of the base model"),
    "rank": (pair(UP, 192, 64, r=3), {}, "which do not fit rank r=2 of adapter_config.json"),
    "dora": (pair(UP, 192, 64), {"use_dora": True}, "DoRA (use_dora) is not supported"),
    "modules_to_save": (pair(UP, 192, 64), {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bias": (pair(UP, 192, 64), {"bias": "lora_only"}, "bias 'lora_only' is not supported"),
    "not_lora": (pair(UP, 192, 64), {"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    "dora_tensor": ({**pair(UP, 192, 64), f"base_model.model.{UP}.lora_magnitude_vector": torch.ones(192)}, {},
                    "lora_magnitude_vector is not a LoRA A/B weight"),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_adapter_is_refused_with_one_line(tiny_loaded, tmp_path, case):
    tensors, config, expected = WRONG[case]
    folder = write_adapter(tmp_path / case, tensors, **config)
    before = tiny_loaded.model.model.language_model.layers[0].mlp.up_proj.weight.clone()
    with pytest.raises(AdapterError) as info:
        resolve_modules(read_adapter(folder), tiny_loaded.model)  # read-only: the shared model is not merged
    message = str(info.value)
    assert expected in message and str(folder) in message and "\n" not in message, message
    assert torch.equal(tiny_loaded.model.model.language_model.layers[0].mlp.up_proj.weight, before)


def test_bin_weights_and_zero3_are_refused(tmp_path):
    folder = write_adapter(tmp_path / "bin", pair(UP, 192, 64))
    os.replace(folder / "adapter_model.safetensors", folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="adapter_model.bin is not supported"):
        read_adapter(folder)
    with pytest.raises(AdapterError, match="cannot be merged under ZeRO-3"):
        read_adapter(folder, zero3=True)


def test_start_engine_refuses_a_wrong_adapter_in_one_line(tiny_checkpoint, tmp_path):
    from qwen_chat.engine.startup import bootstrap

    folder = write_adapter(tmp_path / "wrong", pair(UP, 192, 4096))
    cfg = ServiceConfig(model=str(tiny_checkpoint), adapter=folder, device="cpu", history_dir=tmp_path / "h")
    with pytest.raises(bootstrap.StartupError) as info:
        bootstrap.start_engine(cfg)
    assert str(info.value) == (f"{folder / 'adapter_model.safetensors'}: {UP} is 192 x 4096 (out x in) in the "
                               "adapter but 192 x 64 in the base model (adapter made for another model size?)")


# --- configuration and the API ----------------------------------------------------------------------------------

def test_adapter_flag_is_parsed_and_validated(tmp_path):
    cfg = ServiceConfig.from_argv(["--adapter", str(tmp_path)])
    assert cfg.adapter == tmp_path
    with pytest.raises(ConfigError, match="has no adapter_config.json"):
        cfg.validate()
    with pytest.raises(ConfigError, match="is not a folder"):
        ServiceConfig(adapter=tmp_path / "nope").validate()
    (tmp_path / "adapter_config.json").write_text("{}")
    assert ServiceConfig(adapter=tmp_path).validate().adapter == tmp_path


def test_models_endpoint_shows_the_adapter(tmp_path):
    adapter = tmp_path / "my-sft-lora"
    for cfg, shown in ((ServiceConfig(history_dir=tmp_path, adapter=adapter), "my-sft-lora"),
                       (ServiceConfig(history_dir=tmp_path), None)):
        app, _ = api_app(FakeBackend(), cfg)
        card = TestClient(app).get("/v1/models").json()["data"][0]
        assert card.get("adapter") == shown
