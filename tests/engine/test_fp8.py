"""FP8 weights in the 128 x 128 block format, on CPU: the block quantisation round trip, fusion on block
boundaries, ``--quantize fp8`` on the tiny model against transformers on the dequantised weights (fp32, relative
error <= 1e-4, same greedy tokens), the FP8 checkpoint folder (loads as ``--quantize fp8`` does; each broken variant
refused with its line; ``modules_to_not_convert`` in either spelling of the text decoder), tensor parallel over
two gloo ranks (the tokens of one rank; a share that cuts a block refused), ZeRO-3 refused, and the engine end to
end with the weights reported for ``/v1/models``.  The FP8 GEMV kernels: tests/engine/test_triton_kernels.py."""
from __future__ import annotations

import copy
import functools
import gc
import json
import os
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM

from qwen_chat.config import ConfigError, ServiceConfig
from qwen_chat.engine.checkpoints.fp8_format import default_not_convert, excluded
from qwen_chat.engine.checkpoints.fp8_loading import quantizable, quantize_model, write_fp8_checkpoint
from qwen_chat.engine.checkpoints.layout import INDEX_FILE, CheckpointError, inspect_checkpoint
from qwen_chat.engine.checkpoints.loading import load_model
from qwen_chat.engine.checkpoints.tiny import tiny_config
from qwen_chat.engine.model import fp8
from qwen_chat.engine.model.fp8 import BlockAlignmentError, Fp8Linear, Fp8Weight, quantize_blocks
from qwen_chat.engine.model.fusion import fuse_group
from qwen_chat.engine.model.runner import ModelRunner
from qwen_chat.engine.types import PreparedPrompt
from tests.support.small_model import TOL, rel_err, tiny_prompts
from tests.support.quantized_tp import quantized_tp_body
from tests.support.two_ranks import run_two_ranks

UP = "model.language_model.layers.0.mlp.up_proj"


def expand(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(n/128), ceil(k/128)] repeated to every element [n, k]."""
    return scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


# ---------------------------------------------------------------------------------------------- block format
def test_quantise_then_dequantise_stays_within_half_an_e4m3_step():
    gen = torch.Generator().manual_seed(0)
    n, k = 300, 200  # partial blocks in both directions
    magnitude = torch.logspace(-4, 2, 6).repeat_interleave(50)[:, None]  # blocks of very different ranges
    w = torch.randn(n, k, generator=gen) * magnitude
    w[128:256, 128:] = 0.0  # an all-zero block
    q = quantize_blocks(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (n, k)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (3, 2)
    s = expand(q.scale, n, k)
    err = (q.dequantize(torch.float32) - w).abs()
    assert bool((err <= 2 ** -4 * w.abs() + 2 ** -10 * s).all()), float((err / (w.abs() + s)).max())
    assert float(err.max()) > 0  # the round trip is lossy, the bound is what holds
    blocks = q.data.float().abs()
    for i in range(3):
        for j in range(2):
            block = blocks[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            if (i, j) == (1, 1):
                assert float(q.scale[i, j]) == 1.0 and float(block.max()) == 0.0
            else:  # scale = amax / 448: the block's largest magnitude lands on e4m3's largest value
                assert float(block.max()) == 448.0
                amax = float(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max())
                assert float(q.scale[i, j]) == pytest.approx(amax / 448, rel=1e-6)
    same = quantize_blocks(w.to(torch.bfloat16).float())
    assert torch.equal(quantize_blocks(w.to(torch.bfloat16)).data.view(torch.uint8), same.data.view(torch.uint8))


def test_slices_and_stacks_keep_to_block_boundaries():
    q = quantize_blocks(torch.randn(300, 256, generator=torch.Generator().manual_seed(1)))
    full = q.dequantize()
    tail = q.rows(128, 300)
    assert tail.shape == (172, 256) and tail.scale.shape == (2, 2)
    assert torch.equal(tail.dequantize(), full[128:])
    assert torch.equal(q.cols(128, 256).dequantize(), full[:, 128:])
    for cut in (lambda: q.rows(0, 100), lambda: q.rows(64, 128), lambda: q.cols(0, 64)):
        with pytest.raises(BlockAlignmentError, match="cut a 128 x 128 block"):
            cut()
    again = Fp8Weight.cat_rows([q.rows(0, 128), q.rows(128, 300)])
    assert torch.equal(again.dequantize(), full)
    with pytest.raises(BlockAlignmentError, match="only the last part"):
        Fp8Weight.cat_rows([quantize_blocks(torch.randn(100, 256)), quantize_blocks(torch.randn(128, 256))])


def _fp8_layer(n: int, k: int, seed: int) -> Fp8Linear:
    return Fp8Linear(quantize_blocks(torch.randn(n, k, generator=torch.Generator().manual_seed(seed))))


def test_fp8_projections_fuse_only_on_128_row_boundaries():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    mods = [_fp8_layer(256, 256, 1), _fp8_layer(128, 256, 2), _fp8_layer(40, 256, 3)]
    want = [m(x) for m in mods]
    parts = fuse_group(mods)
    assert parts is not None and len(parts) == 1
    (w, sizes), = parts
    assert isinstance(w, Fp8Weight) and sizes == [256, 128, 40] and w.scale.shape == (4, 2)
    for got, ref in zip(fp8.linear(x, w).split(sizes, dim=-1), want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # the layers now read their rows of the fused weight (views: no memory added), and fusing again finds them
    assert mods[1].weight.untyped_storage().data_ptr() == w.data.untyped_storage().data_ptr()
    assert torch.equal(mods[2](x), want[2])
    assert fuse_group(mods)[0][0].data.data_ptr() == w.data.data_ptr()
    # 192 rows end inside a block: its last scale block would cover the next layer's rows
    assert fuse_group([_fp8_layer(192, 256, 4), _fp8_layer(192, 256, 5)]) is None
    # FP8 qkv/z with bf16 b/a (the published FP8 checkpoint's Gated DeltaNet): one GEMM per kind
    lin = [torch.nn.Linear(256, 32, bias=False) for _ in range(2)]
    mixed = fuse_group([_fp8_layer(256, 256, 6), _fp8_layer(128, 256, 7), *lin])
    assert [type(p[0]) for p in mixed] == [Fp8Weight, torch.Tensor] and [p[1] for p in mixed] == [[256, 128], [32, 32]]


# ---------------------------------------------------------------------------------------------- --quantize fp8
@pytest.fixture(scope="module")
def prompts(tiny_loaded) -> dict[str, PreparedPrompt]:
    """A text prompt and an image prompt for the tiny model."""
    return tiny_prompts(tiny_loaded, "FP8 weights in 128 x 128 blocks")


@pytest.fixture(scope="module")
def quantized(tiny_loaded):
    """The tiny model (fp32 on CPU) after ``--quantize fp8``, and the quantised layer names."""
    model = copy.deepcopy(tiny_loaded.model)
    return model, quantize_model(model)


@torch.no_grad()
def reference_logits(model, prompt: PreparedPrompt, extra: list[int]) -> torch.Tensor:
    """transformers' logits at the last position of ``prompt`` + ``extra`` tokens (one full forward), fp32."""
    ids = torch.cat([prompt.input_ids, torch.tensor(extra, dtype=torch.long)])[None]
    kw = {}
    if prompt.pixel_values is not None:
        mm = torch.cat([prompt.mm_token_type_ids, torch.zeros(len(extra), dtype=torch.long)])
        kw = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=mm[None])
    return model(input_ids=ids, **kw).logits[0, -1]


def test_quantize_fp8_converts_the_layers_the_published_export_does(tiny_loaded):
    model = copy.deepcopy(tiny_loaded.model)
    before = {n: weakref.ref(model.get_submodule(n).weight) for n in quantizable(model)}
    names = quantize_model(model)
    gc.collect()
    assert sorted(names) == sorted(before) and len(names) == 3 * 3 + 4 + 4 * 3
    assert all(ref() is None for ref in before.values())  # every fp32 copy is released, none kept aside
    lm = model.model.language_model
    for la in (layer.linear_attn for layer in lm.layers[:3]):
        assert all(isinstance(m, Fp8Linear) for m in (la.in_proj_qkv, la.in_proj_z, la.out_proj))
        assert type(la.in_proj_a) is type(la.in_proj_b) is torch.nn.Linear
    at = lm.layers[3].self_attn
    assert all(isinstance(m, Fp8Linear) for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj))
    assert type(model.lm_head) is torch.nn.Linear
    assert not any(isinstance(m, Fp8Linear) for m in model.model.visual.modules())
    report = fp8.weights_report(model)
    assert report["fp8_modules"] == 25 and report["fp8_kinds"]["linear_attn.in_proj_qkv"] == 3
    fp32_bytes = sum(tiny_loaded.model.get_submodule(n).weight.numel() * 4 for n in names)
    assert report["fp8_bytes"] < 0.3 * fp32_bytes  # one byte per weight plus the block scales
    assert "for 25 linear layers" in fp8.describe_weights(model, "--quantize fp8")


def test_engine_with_fp8_matches_transformers_on_the_dequantised_weights(tiny_loaded, quantized, prompts):
    model, names = quantized
    reference = copy.deepcopy(tiny_loaded.model)
    with torch.no_grad():
        for name in names:
            reference.get_submodule(name).weight.copy_(model.get_submodule(name).fp8_weight().dequantize())
    runner = ModelRunner(model, num_slots=2, max_context=512, device="cpu")
    order = list(prompts)
    logits = torch.stack([runner.prefill(slot, prompts[name]) for slot, name in enumerate(order)])
    tokens = {name: [] for name in order}
    errs = []
    for step in range(6):
        for row, name in enumerate(order):
            ref = reference_logits(reference, prompts[name], tokens[name])
            errs.append(rel_err(logits[row], ref))
            assert int(logits[row].argmax()) == int(ref.argmax()), (name, step)  # same greedy token
            tokens[name].append(int(logits[row].argmax()))
        logits = runner.decode([0, 1], torch.tensor([tokens[name][-1] for name in order]))
    assert max(errs) <= TOL, errs
    # not vacuous: FP8 weights give other logits than the model's own weights
    assert rel_err(runner.prefill(0, prompts["text"]), reference_logits(tiny_loaded.model, prompts["text"], [])) > 1e-3


# ---------------------------------------------------------------------------------------------- FP8 checkpoints
@pytest.fixture(scope="module")
def fp8_folder(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint written in the published FP8 layout."""
    return write_fp8_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("fp8") / "tiny-fp8")


def variant(folder: Path, out: Path) -> Path:
    """A copy of ``folder`` whose files are hard links (edit a file only through ``rewrite``)."""
    shutil.copytree(folder, out, copy_function=os.link)
    return out


def rewrite_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_tensor(folder: Path, name: str, tensor) -> None:
    """Replace tensor ``name`` in its shard (None: drop it there and from the index)."""
    index = json.loads((folder / INDEX_FILE).read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    if tensor is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = tensor
    shard.unlink()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (folder / INDEX_FILE).unlink()
    (folder / INDEX_FILE).write_text(json.dumps(index))


def test_fp8_checkpoint_loads_as_quantize_fp8_does(fp8_folder, tiny_loaded, quantized, prompts):
    model, names = quantized
    report = inspect_checkpoint(fp8_folder)
    assert sorted(report.fp8.modules) == sorted(names)
    assert "F8_E4M3 25" in report.describe() and "FP8 block format" in report.describe()
    config = json.loads((fp8_folder / "config.json").read_text())["quantization_config"]
    assert {k: config[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in config["modules_to_not_convert"]
    loaded = load_model(fp8_folder, "cpu", torch.float32)
    for name in names:
        ours, want = loaded.model.get_submodule(name).fp8_weight(), model.get_submodule(name).fp8_weight()
        assert torch.equal(ours.data.view(torch.uint8), want.data.view(torch.uint8)), name
        assert torch.equal(ours.scale, want.scale), name
    a = loaded.model.model.language_model.layers[0].linear_attn.in_proj_a
    assert type(a) is torch.nn.Linear
    assert torch.equal(a.weight, tiny_loaded.model.model.language_model.layers[0].linear_attn.in_proj_a.weight)
    ours = ModelRunner(loaded.model, num_slots=1, max_context=256, device="cpu").prefill(0, prompts["image"])
    want = ModelRunner(model, num_slots=1, max_context=256, device="cpu").prefill(0, prompts["image"])
    assert rel_err(ours, want) <= 1e-6


BROKEN = {
    "missing scale": (lambda f: rewrite_tensor(f, UP + ".weight_scale_inv", None),
                      f"{UP}.weight is F8_E4M3 but its block scales {UP}.weight_scale_inv are missing"),
    "block size": (lambda f: rewrite_config(f, lambda c: c["quantization_config"].update(weight_block_size=[64, 64])),
                   "config.json: quantization_config weight_block_size [64, 64] is not supported (only [128, 128])"),
    "quant method": (lambda f: rewrite_config(f, lambda c: c["quantization_config"].update(quant_method="bitsandbytes")),
                     "config.json: quantization_config quant_method 'bitsandbytes' is not supported"),
    "fmt": (lambda f: rewrite_config(f, lambda c: c["quantization_config"].update(fmt="e5m2")),
            "quantization_config fmt 'e5m2' is not supported (only 'e4m3')"),
    "scale shape": (lambda f: rewrite_tensor(f, UP + ".weight_scale_inv", torch.ones(1, 1)),
                    f"{UP}.weight_scale_inv is F32 [1, 1], expected F32 or BF16 or F16 [2, 1]"),
    "no quantization_config": (lambda f: rewrite_config(f, lambda c: c.pop("quantization_config")),
                               "is F8_E4M3 but"),
    "not_convert names an FP8 layer": (
        lambda f: rewrite_config(f, lambda c: c["quantization_config"]["modules_to_not_convert"].append(UP)),
        f"{UP}.weight is F8_E4M3 but quantization_config modules_to_not_convert names {UP}"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_fp8_checkpoint_is_refused_with_one_line(fp8_folder, tmp_path, case):
    edit, message = BROKEN[case]
    folder = variant(fp8_folder, tmp_path / "broken")
    edit(folder)
    with pytest.raises(CheckpointError) as caught:
        inspect_checkpoint(folder)
    line = str(caught.value)
    assert message in line and str(folder) in line and "\n" not in line, line


def test_modules_to_not_convert_match_in_either_spelling_of_the_text_decoder(tiny_checkpoint, fp8_folder, tmp_path):
    prefixed = default_not_convert(tiny_config().text_config.layer_types)
    a = "model.language_model.layers.0.linear_attn.in_proj_a"
    assert excluded("model.layers.0.linear_attn.in_proj_a", prefixed)  # a text-only model's name
    assert excluded(a, ["model.layers.0.linear_attn.in_proj_a"])       # a text-only export's entry
    assert excluded(a, ["in_proj_a"]) and excluded("model.visual.blocks.0.attn.qkv", prefixed)
    assert not excluded("model.language_model.layers.11.mlp.up_proj", ["model.language_model.layers.1"])
    assert not excluded("model.language_model.layers.0.linear_attn.in_proj_qkv", prefixed)
    # a text-only load (Qwen3_5ForCausalLM: model.layers.N...) with the published, prefixed entries: the layers
    # they name stay bf16 (transformers' rule matches them literally and would quantise them)
    text = copy.deepcopy(tiny_config().text_config)
    text.vocab_size = 512
    model = Qwen3_5ForCausalLM(text).eval()
    names = quantize_model(model, not_convert=prefixed)
    layer = model.model.layers[0].linear_attn
    assert type(layer.in_proj_a) is type(layer.in_proj_b) is torch.nn.Linear
    assert isinstance(layer.in_proj_qkv, Fp8Linear) and "model.layers.0.linear_attn.in_proj_qkv" in names
    assert len(names) == 25
    # an FP8 folder whose list uses the text-only spelling loads with the same layers in bf16
    spelled = [n.replace("model.language_model.", "model.") for n in prefixed]
    other = write_fp8_checkpoint(tiny_checkpoint, tmp_path / "text-only-names", not_convert=spelled)
    assert inspect_checkpoint(other).fp8.modules == inspect_checkpoint(fp8_folder).fp8.modules
    loaded = load_model(other, "cpu", torch.float32)
    assert type(loaded.model.model.language_model.layers[0].linear_attn.in_proj_a) is torch.nn.Linear


def test_bf16_block_scales_load_as_fp32(tiny_checkpoint, tmp_path):
    folder = write_fp8_checkpoint(tiny_checkpoint, tmp_path / "bf16-scales", scale_dtype=torch.bfloat16)
    assert inspect_checkpoint(folder).tensors[UP + ".weight_scale_inv"][0] == "BF16"
    loaded = load_model(folder, "cpu", torch.float32)
    scale = loaded.model.get_submodule(UP).weight_scale_inv
    stored = load_file(str(folder / inspect_checkpoint(folder).shard_of[UP + ".weight_scale_inv"]))
    assert scale.dtype == torch.float32 and torch.equal(scale, stored[UP + ".weight_scale_inv"].float())


# ---------------------------------------------------------------------------------------------- sharding
def _tp_config(intermediate: int):
    """The tiny config with a small vocabulary and MLP width ``intermediate`` (256: every rank share of two is a
    whole number of 128-row blocks; the tiny model's 192: its MLP shares are not)."""
    config = tiny_config()
    config.text_config.intermediate_size = intermediate
    config.text_config.vocab_size = 1024
    return config


#: One rank's part: MLP width 256 keeps the blocks whole on each rank, 192 cuts them.
_tp_body = functools.partial(quantized_tp_body, config_of=_tp_config, quantize=quantize_model, kind="fp8",
                             fits=256, cuts=192)


@pytest.mark.slow  # two processes import deepspeed and build the model (~30 s on 2 CPU cores)
def test_tensor_parallel_fp8_gives_the_tokens_of_one_rank(tmp_path):
    for rep in run_two_ranks(_tp_body, tmp_path, "gloo"):
        assert rep["errors"] == [], rep
        assert rep["tp2"] == rep["tp1"], rep
        assert rep["rel_err"] <= TOL, rep
        # o_proj, down_proj x4 and the Gated DeltaNet out_proj x3: FP8 shards summed by an all-reduce
        assert rep["row_parallel"] == 1 + 4 + 3 and rep["quantized_layers"] == 25
        first, last = 96 * rep["rank"], 96 * (rep["rank"] + 1)  # this rank's share of the 192 MLP rows
        assert rep["refusal"] == ("tensor parallel over 2 ranks would cut the 128 x 128 FP8 blocks of "
                                  f"model.language_model.layers.0.mlp.gate_proj: rows {first}..{last} of 192 cut a "
                                  "128 x 128 block; serve this model on fewer GPUs (or one), or in bf16"), rep["refusal"]


def test_zero3_with_fp8_weights_is_refused(quantized):
    from qwen_chat.engine.parallel import sharding

    plan = sharding.ShardingPlan(mode="zero3", tp_size=1, world_size=1, ds_config={"zero_optimization": {"stage": 3}})
    with pytest.raises(sharding.ShardingError, match="^ZeRO-3 cannot hold FP8 weights .*without --quantize fp8"):
        sharding.shard_model(quantized[0], plan, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- the service
def test_quantize_flag_takes_fp8_int4_or_none(monkeypatch, tmp_path):
    assert ServiceConfig.from_argv(["--quantize", "fp8", "--history-dir", str(tmp_path)]).validate().quantize == "fp8"
    monkeypatch.setenv("QWEN_CHAT_QUANTIZE", "fp8")  # e.g. set in a Supervisor program; the flag switches it off
    assert ServiceConfig.from_argv(["--history-dir", str(tmp_path)]).validate().quantize == "fp8"
    off = ServiceConfig.from_argv(["--quantize", "none", "--history-dir", str(tmp_path)]).validate()
    assert off.quantize == "none"
    assert ServiceConfig.from_argv(["--quantize", "int4", "--history-dir", str(tmp_path)]).validate().quantize == "int4"
    monkeypatch.setenv("QWEN_CHAT_QUANTIZE", "int8")
    with pytest.raises(ConfigError, match="--quantize .* must be one of none, fp8, int4, got 'int8'"):
        ServiceConfig.from_argv(["--history-dir", str(tmp_path)]).validate()


def test_engine_runs_an_fp8_checkpoint_and_reports_its_weights(fp8_folder, tmp_path):
    from qwen_chat.engine.startup.runner_setup import build_engine

    loaded = load_model(fp8_folder, "cpu")
    cfg = ServiceConfig(model=str(fp8_folder), history_dir=tmp_path, memory_budget_gib=0.02, max_context=256)
    engine = build_engine(loaded, cfg, exit_on_failure=False)
    try:
        assert engine.health()["self_check"] == "passed"
        weights = engine.memory_report()["weights"]
        assert weights["dtype"] == "float32" and weights["fp8_modules"] == 25
        assert weights["fp8_kinds"]["mlp.down_proj"] == 4 and weights["fp8_bytes"] > 0
    finally:
        engine.close()


def test_lora_adapter_merges_into_fp8_layers(fp8_folder, tmp_path):
    """An adapter on an FP8 layer is merged into its dequantised weight and quantised again (error within the
    block format's bound); on a bf16 layer of the same checkpoint it is merged as usual."""
    from qwen_chat.engine.checkpoints.adapters import merge_adapter, read_adapter

    a_proj = "model.language_model.layers.0.linear_attn.in_proj_a"
    gen = torch.Generator().manual_seed(3)
    loaded = load_model(fp8_folder, "cpu", torch.float32)
    up, a = loaded.model.get_submodule(UP), loaded.model.get_submodule(a_proj)
    pairs = {UP: (torch.randn(4, up.in_features, generator=gen) * 0.1, torch.randn(up.out_features, 4, generator=gen)),
             a_proj: (torch.randn(4, a.in_features, generator=gen) * 0.1, torch.randn(a.out_features, 4, generator=gen))}
    save_file({f"base_model.model.{m}.lora_{k}.weight": t for m, (A, B) in pairs.items() for k, t in zip("AB", (A, B))},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["up_proj", "in_proj_a"]}))
    want = {UP: up.fp8_weight().dequantize() + 2.0 * pairs[UP][1] @ pairs[UP][0],
            a_proj: a.weight.detach() + 2.0 * pairs[a_proj][1] @ pairs[a_proj][0]}
    assert sorted(merge_adapter(loaded.model, read_adapter(tmp_path))) == sorted(pairs)
    merged_up = loaded.model.get_submodule(UP)
    assert isinstance(merged_up, Fp8Linear)
    w = merged_up.fp8_weight()
    err = (w.dequantize() - want[UP]).abs()
    assert bool((err <= 2 ** -4 * want[UP].abs() + 2 ** -10 * expand(w.scale, *w.shape)).all())
    torch.testing.assert_close(loaded.model.get_submodule(a_proj).weight, want[a_proj])
