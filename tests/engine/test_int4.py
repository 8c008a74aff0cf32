"""4-bit weights (W4A16, groups of 128 input columns) on CPU: the group quantisation's error bound, the packed
layouts of GPTQ, AWQ and compressed-tensors against the formats' published rules, a 4-bit checkpoint in each
format written from a tiny model (text hidden 128, so every decoder projection has whole groups) that loads and
matches transformers on the dequantised weights (fp32, relative error <= 1e-4, same greedy tokens) as does
``--quantize int4``, each broken variant refused in one line naming the file, a LoRA merge refused, ZeRO-3
refused, the weights reported for ``/v1/models``, and tensor parallel over two gloo ranks (the tokens of one
rank; a share that cuts a group refused).  The Triton kernels: tests/engine/test_triton_kernels.py; the service
with ``--quantize int4`` through the API: tests/service/test_int4_service.py."""
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
from transformers import Qwen3_5ForConditionalGeneration

from qwen_chat.engine.checkpoints.int4_format import AWQ_ORDER
from qwen_chat.engine.checkpoints.int4_loading import decode, encode, quantize_model, write_int4_checkpoint
from qwen_chat.engine.checkpoints.layout import INDEX_FILE, CheckpointError, inspect_checkpoint, write_weights
from qwen_chat.engine.checkpoints.loading import load_model
from qwen_chat.engine.checkpoints.tiny import tiny_config
from qwen_chat.engine.model import fp8
from qwen_chat.engine.model.int4 import (GroupAlignmentError, Int4Linear, Int4Weight, pack, quantize_groups,
                                         unpack)
from qwen_chat.engine.model.runner import ModelRunner
from tests.support.small_model import TOL, rel_err, tiny_prompts
from tests.support.quantized_tp import quantized_tp_body
from tests.support.two_ranks import run_two_ranks

UP = "model.language_model.layers.0.mlp.up_proj"
#: The formats as public exports write them: (method, symmetric, GPTQ checkpoint_format).
FORMATS = {"gptq": ("gptq", True, "gptq"), "gptq-v2-asym": ("gptq", False, "gptq_v2"), "awq": ("awq", False, "gptq"),
           "compressed-tensors": ("compressed-tensors", True, "gptq"),
           "compressed-tensors-asym": ("compressed-tensors", False, "gptq")}


def nibble(word: int, i: int) -> int:
    return (int(word) >> (4 * i)) & 15


# ---------------------------------------------------------------------------------------------- the format
@pytest.mark.parametrize("symmetric", [False, True])
def test_group_quantisation_stays_within_half_a_step(symmetric):
    gen = torch.Generator().manual_seed(0)
    n, k = 24, 384
    magnitude = torch.logspace(-3, 1, 3).repeat_interleave(128)[None, :]  # groups of very different ranges
    w = torch.randn(n, k, generator=gen) * magnitude
    w[3, 128:256] = 0.0                                                    # an all-zero group
    w[5, :128] = w[5, :128].abs() + 0.5                                    # a group without negatives
    q = quantize_groups(w, symmetric=symmetric)
    assert q.packed.shape == (n, k // 8) and q.packed.dtype == torch.int32
    assert q.scale.shape == q.zero.shape == (n, 3) and q.zero.dtype == torch.uint8
    s = q.scale.repeat_interleave(128, 1)
    err = (q.dequantize() - w).abs()
    assert bool((err <= s / 2 * (1 + 1e-6)).all()), float((err / s).max())
    assert float(err.max()) > 0
    assert float(q.dequantize()[3, 128:256].abs().max()) == 0.0            # zero stays exactly zero
    if symmetric:
        assert bool((q.zero == 8).all())
    else:  # the full 0..15 range is used: the group's min and max land on the end values
        vals = unpack(q.packed).view(n, 3, 128)
        assert int(vals[0, 1].min()) == 0 and int(vals[0, 1].max()) == 15
        assert int(q.zero[5, 0]) == 0                                      # min clamped to 0: zero point 0


def test_packing_puts_column_8i_plus_j_in_nibble_j_of_word_i():
    q = torch.arange(16, dtype=torch.uint8).repeat(2, 1)                 # [2, 16]: values 0..15
    words = pack(q)
    assert words.shape == (2, 2)
    assert [nibble(words[0, 0], j) for j in range(8)] == list(range(8))
    assert int(words[0, 0]) == 0x76543210 and int(words[0, 1]) == int(torch.tensor(0xFEDCBA98).to(torch.int32))
    assert torch.equal(unpack(words), q)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(q[:, :12])


@pytest.fixture(scope="module")
def small_weight() -> Int4Weight:
    """A [16, 256] 4-bit weight with zero points 1..15 (every format can store them) and fp16-exact scales."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (16, 256), generator=gen, dtype=torch.uint8)
    zero = torch.randint(1, 16, (16, 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(16, 2, generator=gen) + 0.1).half().float()
    return Int4Weight(pack(q), scale, zero)


def test_stored_layouts_follow_the_published_formats(small_weight):
    """Each format's words against its public rule, element by element (int4_format's docstring): GPTQ packs
    along K into [K/8, N] and stores zero points minus one (v1) along N; AWQ packs along N in the order
    0, 2, 4, 6, 1, 3, 5, 7; compressed-tensors packs along K into [N, K/8] and asymmetric zero points along N."""
    w = small_weight
    q, zero = unpack(w.packed), w.zero
    g = encode(w, "gptq", False, zeros_minus_one=True)
    a = encode(w, "awq", False)
    c = encode(w, "compressed-tensors", False, torch.bfloat16)
    for n, k in [(0, 0), (3, 17), (15, 255), (9, 130)]:
        assert nibble(g[".qweight"][k // 8, n], k % 8) == q[n, k]
        assert nibble(c[".weight_packed"][n, k // 8], k % 8) == q[n, k]
        assert nibble(a[".qweight"][k, n // 8], AWQ_ORDER.index(n % 8)) == q[n, k]
        grp = k // 128
        assert nibble(g[".qzeros"][grp, n // 8], n % 8) == zero[n, grp] - 1
        assert nibble(a[".qzeros"][grp, n // 8], AWQ_ORDER.index(n % 8)) == zero[n, grp]
        assert nibble(c[".weight_zero_point"][n // 8, grp], n % 8) == zero[n, grp]
    assert g[".qweight"].shape == (32, 16) and a[".qweight"].shape == (256, 2) and c[".weight_packed"].shape == (16, 32)
    assert g[".scales"].shape == a[".scales"].shape == (2, 16) and c[".weight_scale"].shape == (16, 2)
    assert torch.equal(g[".g_idx"], (torch.arange(256) // 128).to(torch.int32))
    assert c[".weight_shape"].tolist() == [16, 256]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decoding_a_stored_layer_gives_the_weight_back_exactly(small_weight, fmt):
    from qwen_chat.engine.checkpoints.int4_format import Int4Spec

    method, symmetric, gptq_format = FORMATS[fmt]
    w = small_weight
    if symmetric:
        w = Int4Weight(w.packed, w.scale, torch.full_like(w.zero, 8))
    stored = encode(w, method, symmetric, zeros_minus_one=gptq_format == "gptq")
    spec = Int4Spec(method, symmetric, method == "gptq" and gptq_format == "gptq", (), (), {})
    back = decode(spec, stored, "x")
    assert torch.equal(back.packed, w.packed) and torch.equal(back.zero, w.zero)
    assert torch.equal(back.scale, w.scale)


def test_rows_slice_anywhere_columns_only_on_group_boundaries(small_weight):
    w = small_weight
    full = w.dequantize()
    assert torch.equal(w.rows(3, 11).dequantize(), full[3:11])
    assert torch.equal(w.cols(128, 256).dequantize(), full[:, 128:])
    assert torch.equal(Int4Weight.cat_rows([w.rows(0, 5), w.rows(5, 16)]).dequantize(), full)
    for cut in (lambda: w.cols(0, 64), lambda: w.cols(64, 256)):
        with pytest.raises(GroupAlignmentError, match="cut a group of 128 input columns"):
            cut()
    with pytest.raises(GroupAlignmentError, match="not a multiple of the group size 128"):
        quantize_groups(torch.randn(8, 192))


# ---------------------------------------------------------------------------------------------- checkpoints
def wide_config():
    """The tiny config with text hidden 128 and MLP 256: every decoder projection has whole groups of 128."""
    config = tiny_config()
    config.text_config.hidden_size = 128
    config.text_config.intermediate_size = 256
    config.vision_config.out_hidden_size = 128
    return config


@pytest.fixture(scope="module")
def wide_folder(tiny_checkpoint, tmp_path_factory) -> Path:
    """A bf16 checkpoint folder of ``wide_config`` (random weights) with the tiny checkpoint's tokenizer files."""
    out = tmp_path_factory.mktemp("int4") / "wide"
    shutil.copytree(tiny_checkpoint, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX_FILE))
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["text_config"].update(hidden_size=128, intermediate_size=256)
    config["vision_config"]["out_hidden_size"] = 128
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(wide_config())
    write_weights({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, out, num_shards=2)
    return out


@pytest.fixture(scope="module")
def wide_loaded(wide_folder):
    return load_model(wide_folder, "cpu", torch.float32)


@pytest.fixture(scope="module")
def prompts(wide_loaded):
    return tiny_prompts(wide_loaded, "Four bits per weight in groups of 128")


@torch.no_grad()
def reference_logits(model, prompt, extra: list[int]) -> torch.Tensor:
    """transformers' logits at the last position of ``prompt`` + ``extra`` tokens (one full forward), fp32."""
    ids = torch.cat([prompt.input_ids, torch.tensor(extra, dtype=torch.long)])[None]
    kw = {}
    if prompt.pixel_values is not None:
        mm = torch.cat([prompt.mm_token_type_ids, torch.zeros(len(extra), dtype=torch.long)])
        kw = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=mm[None])
    return model(input_ids=ids, **kw).logits[0, -1]


def engine_matches_transformers(model, base, prompts) -> float:
    """Prefill both prompts and decode 5 steps with the engine's runner on ``model`` (4-bit layers); each step's
    logits against transformers on ``base`` with the 4-bit layers' dequantised weights.  Returns the worst
    relative error; asserts the same greedy tokens."""
    reference = copy.deepcopy(base)
    names = [n for n, m in model.named_modules() if isinstance(m, Int4Linear)]
    with torch.no_grad():
        for name in names:
            reference.get_submodule(name).weight.copy_(model.get_submodule(name).int4_weight().dequantize())
    runner = ModelRunner(model, num_slots=2, max_context=512, device="cpu")
    order = list(prompts)
    logits = torch.stack([runner.prefill(slot, prompts[name]) for slot, name in enumerate(order)])
    tokens = {name: [] for name in order}
    errs = []
    for step in range(5):
        for row, name in enumerate(order):
            ref = reference_logits(reference, prompts[name], tokens[name])
            errs.append(rel_err(logits[row], ref))
            assert int(logits[row].argmax()) == int(ref.argmax()), (name, step)
            tokens[name].append(int(logits[row].argmax()))
        logits = runner.decode([0, 1], torch.tensor([tokens[name][-1] for name in order]))
    # not vacuous: the 4-bit weights give other logits than the model's own weights
    assert rel_err(runner.prefill(0, prompts["text"]), reference_logits(base, prompts["text"], [])) > 1e-3
    return max(errs)


def test_quantize_int4_converts_the_decoder_projections_and_matches_transformers(wide_loaded, prompts):
    model = copy.deepcopy(wide_loaded.model)
    before = {n: weakref.ref(m.weight) for n, m in model.named_modules()
              if type(m) is torch.nn.Linear and ".language_model.layers." in n}
    names = quantize_model(model)
    gc.collect()
    assert len(names) == 25 and all(before[n]() is None for n in names)  # fp32 copies released
    lm = model.model.language_model
    la = lm.layers[0].linear_attn
    assert type(la.in_proj_a) is type(la.in_proj_b) is torch.nn.Linear  # left bf16, as the FP8 export does
    assert type(model.lm_head) is torch.nn.Linear
    assert not any(isinstance(m, Int4Linear) for m in model.model.visual.modules())
    report = fp8.weights_report(model)
    assert report["int4_modules"] == 25 and report["int4_group_size"] == 128
    assert report["int4_sources"] == ["--quantize int4"] and report["int4_kinds"]["mlp.down_proj"] == 4
    fp32_bytes = sum(wide_loaded.model.get_submodule(n).weight.numel() * 4 for n in names)
    assert report["int4_bytes"] < 0.15 * fp32_bytes  # half a byte per weight plus scales and zero points
    assert "4-bit (W4A16, groups of 128 input columns, --quantize int4) for 25 linear layers" in \
        fp8.describe_weights(model, "--quantize int4")
    assert engine_matches_transformers(model, wide_loaded.model, prompts) <= TOL


@pytest.fixture(scope="module")
def int4_folders(wide_folder, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("int4-formats")
    return {fmt: write_int4_checkpoint(wide_folder, root / fmt, method, symmetric=sym, gptq_format=gf)
            for fmt, (method, sym, gf) in FORMATS.items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int4_checkpoint_loads_and_matches_transformers(int4_folders, wide_loaded, prompts, fmt):
    folder, written = int4_folders[fmt]
    report = inspect_checkpoint(folder)
    assert report.int4.method == FORMATS[fmt][0] and sorted(report.int4.modules) == sorted(written)
    assert len(written) == 25 and f"4-bit {FORMATS[fmt][0]} (25 layers, groups of 128" in report.describe()
    loaded = load_model(folder, "cpu", torch.float32)
    for name, want in written.items():
        got = loaded.model.get_submodule(name).int4_weight()
        assert torch.equal(got.packed, want.packed) and torch.equal(got.zero, want.zero)
        assert torch.equal(got.scale, want.scale)
    # everything else loaded from the checkpoint as it is
    assert torch.equal(loaded.model.lm_head.weight, wide_loaded.model.lm_head.weight)
    assert "4-bit" in fp8.describe_weights(loaded.model, "checkpoint")
    assert fp8.weights_report(loaded.model)["int4_sources"] == [FORMATS[fmt][0]]
    assert engine_matches_transformers(loaded.model, wide_loaded.model, prompts) <= TOL


def variant(folder: Path, out: Path) -> Path:
    """A copy of ``folder`` whose files are hard links (edit a file only through the rewrite helpers)."""
    shutil.copytree(folder, out, copy_function=os.link)
    return out


def rewrite_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_tensor(folder: Path, name: str, tensor) -> str:
    """Replace tensor ``name`` in its shard (None: drop it there and from the index); returns the shard name."""
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
    return shard.name


BROKEN = {  # case: (format, edit -> file named (None: config.json), message)
    "group size": ("gptq", lambda f: rewrite_config(f, lambda q: q.update(group_size=64)),
                   "quantization_config group_size 64 is not supported (only 128"),
    "bits": ("awq", lambda f: rewrite_config(f, lambda q: q.update(bits=8)),
             "quantization_config bits 8 is not supported (only 4"),
    "bits (compressed-tensors)": ("compressed-tensors", lambda f: rewrite_config(
        f, lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8)),
        "quantization_config config_groups.group_0.weights.num_bits 8 is not supported (only 4"),
    "activations": ("compressed-tensors", lambda f: rewrite_config(
        f, lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8})),
        "config_groups.group_0.input_activations is set; only weight-only 4-bit (W4A16) is supported"),
    "awq packing": ("awq", lambda f: rewrite_config(f, lambda q: q.update(version="gemv")),
                    "quantization_config version 'gemv' is not supported (only 'gemm'"),
    "missing scales": ("gptq", lambda f: rewrite_tensor(f, UP + ".scales", None),
                       f"{UP}.qweight is 4-bit (gptq) but its {UP}.scales is missing"),
    "missing zero points": ("compressed-tensors-asym", lambda f: rewrite_tensor(f, UP + ".weight_zero_point", None),
                            f"{UP}.weight_packed is 4-bit (compressed-tensors) but its {UP}.weight_zero_point is missing"),
    "scales of groups of 64": ("awq", lambda f: rewrite_tensor(f, UP + ".scales", torch.ones(2, 256).half()),
                               f"{UP}.scales is F16 [2, 256], expected F16 or BF16 or F32 [1, 256]"),
    "packed values of another dtype": ("compressed-tensors", lambda f: rewrite_tensor(
        f, UP + ".weight_packed", torch.zeros(256, 16, dtype=torch.int64)),
        f"{UP}.weight_packed is I64 [256, 16], expected I32 [256, 16]"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_int4_checkpoint_is_refused_with_one_line(int4_folders, tmp_path, case):
    fmt, edit, message = BROKEN[case]
    folder = variant(int4_folders[fmt][0], tmp_path / "broken")
    named = edit(folder) or "config.json"
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(folder)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(folder / named)) and message in text, text


def test_activation_order_is_refused_when_the_weights_load(int4_folders, tmp_path):
    down = "model.language_model.layers.0.mlp.down_proj"  # 256 input columns: two groups
    folder = variant(int4_folders["gptq"][0], tmp_path / "act-order")
    shard = rewrite_tensor(folder, down + ".g_idx", (torch.arange(256).flip(0) // 128).to(torch.int32))
    inspect_checkpoint(folder)  # shapes and dtypes are fine: the values are read when the weights load
    with pytest.raises(CheckpointError, match=r"group index is not k // 128 \(activation order, desc_act\)") as info:
        load_model(folder, "cpu", torch.float32)
    assert str(info.value).startswith(f"{folder / shard}: {down}")


def test_lora_merge_into_4bit_layers_is_refused(int4_folders, tmp_path):
    from qwen_chat.engine.checkpoints.adapters import AdapterError, merge_adapter, read_adapter

    loaded = load_model(int4_folders["awq"][0], "cpu", torch.float32)
    up = loaded.model.get_submodule(UP)
    save_file({f"base_model.model.{UP}.lora_A.weight": torch.zeros(4, up.in_features),
               f"base_model.model.{UP}.lora_B.weight": torch.zeros(up.out_features, 4)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["up_proj"]}))
    before = up.int4_weight().packed.clone()
    with pytest.raises(AdapterError, match=f"module {UP} holds 4-bit weights \\(awq\\); a LoRA adapter is not "
                                           "merged into them .* --adapter and --quantize int4"):
        merge_adapter(loaded.model, read_adapter(tmp_path))
    assert torch.equal(loaded.model.get_submodule(UP).int4_weight().packed, before)


def test_engine_reports_its_4bit_weights(int4_folders, tmp_path):
    from qwen_chat.config import ServiceConfig
    from qwen_chat.engine.startup.runner_setup import build_engine

    folder = int4_folders["compressed-tensors"][0]
    loaded = load_model(folder, "cpu")
    cfg = ServiceConfig(model=str(folder), history_dir=tmp_path, memory_budget_gib=0.02, max_context=256)
    engine = build_engine(loaded, cfg, exit_on_failure=False)
    try:
        assert engine.health()["self_check"] == "passed"
        weights = engine.memory_report()["weights"]
        assert weights["int4_modules"] == 25 and weights["fp8_modules"] == 0
        assert weights["int4_sources"] == ["compressed-tensors"] and weights["int4_group_size"] == 128
        assert weights["int4_kinds"]["linear_attn.in_proj_qkv"] == 3 and weights["int4_bytes"] > 0
    finally:
        engine.close()


def test_zero3_with_4bit_weights_is_refused(wide_loaded):
    from qwen_chat.engine.parallel import sharding

    model = copy.deepcopy(wide_loaded.model)
    quantize_model(model)
    plan = sharding.read_plan(Path(__file__).resolve().parents[2] / "deploy" / "ds_config.zero3.json", 1, "cpu")
    with pytest.raises(sharding.ShardingError, match="^ZeRO-3 cannot hold 4-bit weights .*without --quantize int4"):
        sharding.shard_model(model, plan, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- sharding
def _tp_config(intermediate: int):
    config = wide_config()
    config.text_config.intermediate_size = intermediate
    config.text_config.vocab_size = 1024
    return config


#: One rank's part: MLP width 512 keeps the blocks whole on each rank, 384 cuts them.
_tp_body = functools.partial(quantized_tp_body, config_of=_tp_config, quantize=quantize_model, kind="int4",
                             fits=512, cuts=384)


@pytest.mark.slow  # two processes import deepspeed and build the model (~30 s on 2 CPU cores)
def test_tensor_parallel_int4_gives_the_tokens_of_one_rank(tmp_path):
    for rep in run_two_ranks(_tp_body, tmp_path, "gloo"):
        assert rep["errors"] == [], rep
        assert rep["tp2"] == rep["tp1"], rep
        assert rep["rel_err"] <= TOL, rep
        # o_proj, down_proj x4 and the Gated DeltaNet out_proj x3: 4-bit shards summed by an all-reduce
        assert rep["row_parallel"] == 1 + 4 + 3 and rep["quantized_layers"] == 25
        first, last = 192 * rep["rank"], 192 * (rep["rank"] + 1)
        assert rep["refusal"] == ("tensor parallel over 2 ranks would cut the 4-bit groups of "
                                  f"model.language_model.layers.0.mlp.down_proj: columns {first}..{last} of 384 "
                                  "cut a group of 128 input columns; serve this model on fewer GPUs (or one), or "
                                  "in bf16"), rep["refusal"]


def test_measured_tiles_are_used_when_valid(tmp_path, monkeypatch):
    from qwen_chat.engine.model import int4_gemv

    tiles = {"1:4096:4096": {"BLOCK_N": 32, "R": 4, "num_warps": 8, "num_stages": 3},
             "16:4096:4096": {"BLOCK_B": 16, "BLOCK_N": 8, "num_warps": 4, "num_stages": 3}}  # BLOCK_N < 16: invalid
    (tmp_path / "int4_tiles.json").write_text(json.dumps({"source": {}, "tiles": tiles}))
    monkeypatch.setattr(int4_gemv, "TILES_FILE", tmp_path / "int4_tiles.json")
    int4_gemv.tuned.cache_clear()
    try:
        assert int4_gemv.pick_config(1, 4096, 4096) == tiles["1:4096:4096"]
        fallback = int4_gemv.pick_config(4, 4096, 4096)  # the invalid tile is ignored: the default pattern
        assert fallback["BLOCK_B"] == 16 and fallback["BLOCK_N"] >= 16
        assert int4_gemv.pick_config(1, 4096, 12288) == dict(BLOCK_N=4, R=8, num_warps=8, num_stages=3)
    finally:
        int4_gemv.tuned.cache_clear()
