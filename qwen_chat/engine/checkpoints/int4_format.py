"""The 4-bit checkpoint formats the service accepts, checked from config.json and the safetensors headers alone.

Three weight-only (W4A16) formats, group size 128, as public Qwen3.5 / Qwen3 4-bit exports declare them
(docs/checkpoints.md, "4-bit weights", says what was verified and where).  For a linear layer ``<m>`` with
N outputs, K inputs and G = K / 128 groups, value q in 0..15, zero point z, scale s, w = (q - z) * s:

- ``gptq`` (AutoGPTQ / GPTQModel; ``quantization_config`` {``quant_method`` "gptq", ``bits`` 4, ``group_size``
  128, ``sym``, ``desc_act``, ``checkpoint_format`` "gptq" or "gptq_v2"}): ``<m>.qweight`` I32 [K/8, N] (eight
  values along K per word, lowest bits first), ``<m>.qzeros`` I32 [G, N/8] (eight zero points along N per
  word), ``<m>.scales`` [G, N], ``<m>.g_idx`` I32 [K] (optional).  ``checkpoint_format`` "gptq" (v1, the
  default) stores each zero point minus one; "gptq_v2" stores it as it is;
- ``awq`` (AutoAWQ GEMM; {``quant_method`` "awq", ``bits`` 4, ``group_size`` 128, ``zero_point``, ``version``
  "gemm", ``zero_point`` true}): ``<m>.qweight`` I32 [K, N/8] and ``<m>.qzeros`` I32 [G, N/8], eight values along N per word in the
  order 0, 2, 4, 6, 1, 3, 5, 7 (word nibble i holds column 8c + ``AWQ_ORDER[i]``), ``<m>.scales`` [G, N];
- ``compressed-tensors`` ``pack-quantized`` (llm-compressor; {``quant_method`` "compressed-tensors", ``format``
  "pack-quantized", ``config_groups`` whose ``weights`` are {``num_bits`` 4, ``type`` "int", ``strategy``
  "group", ``group_size`` 128, ``symmetric``}, ``input_activations`` null, ``ignore`` [...]}):
  ``<m>.weight_packed`` I32 [N, K/8] (the engine's own layout: signed values stored plus 8),
  ``<m>.weight_scale`` [N, G], ``<m>.weight_shape`` [2] = [N, K], and when asymmetric
  ``<m>.weight_zero_point`` I32 [N/8, G] (eight zero points along N per word, plus 8); symmetric: z = 8.

Scales may be F16, BF16 or F32 (converted to fp32, exactly).  Which modules are 4-bit is read from the tensors
present; ``modules_to_not_convert`` / ``ignore`` must not name one of them.  Refused, in one line naming the
file: another bit width or group size, activation quantisation, an unknown packing (``version`` other than
"gemm", a GPTQ ``checkpoint_format`` other than the two, another ``format``), a quantised layer with a tensor
missing or of the wrong dtype or shape.  A GPTQ ``g_idx`` or compressed-tensors ``weight_g_idx`` other than
k // 128 (activation order, ``desc_act``) is refused when the weights load (``int4_loading``): the engine's
kernels read groups of consecutive columns.  ``mtp.*`` tensors are not loaded and not checked.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from qwen_chat.engine.checkpoints.errors import CheckpointError

METHODS = ("gptq", "awq", "compressed-tensors")
BITS = 4
GROUP_SIZE = 128
#: AWQ's packing order along N: nibble i of a word holds column 8c + AWQ_ORDER[i] (AutoAWQ ``WQLinear_GEMM``).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SCALE_DTYPES = ("F16", "BF16", "F32")
MTP_PREFIX = "mtp."
#: The tensor that marks a 4-bit layer, per method.
MARKER = {"gptq": ".qweight", "awq": ".qweight", "compressed-tensors": ".weight_packed"}
#: Every tensor suffix a 4-bit layer may store, per method (others of the module are refused).
SUFFIXES = {"gptq": (".qweight", ".qzeros", ".scales", ".g_idx"),
            "awq": (".qweight", ".qzeros", ".scales"),
            "compressed-tensors": (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point",
                                   ".weight_g_idx")}


class Int4FormatError(CheckpointError):
    """The 4-bit part of a checkpoint is not in an accepted format; the message is one line naming the file."""


@dataclass(frozen=True)
class Int4Spec:
    """The 4-bit weights of a checkpoint: ``method`` ("gptq", "awq", "compressed-tensors"), ``symmetric``
    (zero point 8 everywhere, nothing stored), ``zeros_minus_one`` (GPTQ v1: stored zero points are one less),
    ``modules`` (module names, sorted), ``not_convert`` (the config's list of modules left unquantised),
    ``config`` (the whole ``quantization_config``)."""

    method: str
    symmetric: bool
    zeros_minus_one: bool
    modules: tuple[str, ...]
    not_convert: tuple[str, ...]
    config: Mapping[str, Any]


def is_int4_config(quantization: Any) -> bool:
    """Whether a ``quantization_config`` names one of the 4-bit methods (it may still be refused)."""
    return isinstance(quantization, dict) and quantization.get("quant_method") in METHODS


def _need(config_file: Path, what: str, value: Any, want: Any) -> None:
    if value != want:
        raise Int4FormatError(f"{config_file}: quantization_config {what} {value!r} is not supported (only {want!r}"
                              f"; 4-bit weights in groups of {GROUP_SIZE} input columns)")


def _names(config_file: Path, value: Any, key: str) -> tuple[str, ...]:
    value = value or []
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise Int4FormatError(f"{config_file}: quantization_config {key} is not a list of names")
    return tuple(value)


def _compressed_tensors(config_file: Path, q: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Int4FormatError(f"{config_file}: quantization_config config_groups is missing")
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise Int4FormatError(f"{config_file}: quantization_config config_groups.{name} has no weights")
        _need(config_file, f"config_groups.{name}.format", group.get("format") or q.get("format"), "pack-quantized")
        w = group["weights"]
        _need(config_file, f"config_groups.{name}.weights.num_bits", w.get("num_bits"), BITS)
        _need(config_file, f"config_groups.{name}.weights.type", w.get("type", "int"), "int")
        _need(config_file, f"config_groups.{name}.weights.strategy", w.get("strategy"), "group")
        _need(config_file, f"config_groups.{name}.weights.group_size", w.get("group_size"), GROUP_SIZE)
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                raise Int4FormatError(f"{config_file}: quantization_config config_groups.{name}.{act} is set; only "
                                      "weight-only 4-bit (W4A16) is supported")
        schemes.add(bool(w.get("symmetric", True)))
    if len(schemes) != 1:
        raise Int4FormatError(f"{config_file}: quantization_config config_groups mix symmetric and asymmetric "
                              "weights (not supported)")
    _need(config_file, "format", q.get("format", "pack-quantized"), "pack-quantized")
    if q.get("quantization_status", "compressed") != "compressed":
        raise Int4FormatError(f"{config_file}: quantization_config quantization_status "
                              f"{q.get('quantization_status')!r} is not supported (only 'compressed')")
    if q.get("sparsity_config"):
        raise Int4FormatError(f"{config_file}: quantization_config sparsity_config is set (not supported)")
    return schemes.pop(), _names(config_file, q.get("ignore"), "ignore")


def check_int4_config(config_file: Path, quantization: Mapping[str, Any]) -> tuple[str, bool, bool, tuple[str, ...]]:
    """Check a 4-bit ``quantization_config`` (``is_int4_config``); returns (method, symmetric, zeros stored minus
    one, modules left unquantised).  Raises Int4FormatError naming ``config_file`` (module docstring)."""
    method = quantization["quant_method"]
    if method == "compressed-tensors":
        symmetric, ignore = _compressed_tensors(config_file, quantization)
        return method, symmetric, False, ignore
    bits = quantization.get("bits", quantization.get("w_bit"))
    _need(config_file, "bits", bits, BITS)
    _need(config_file, "group_size", quantization.get("group_size", quantization.get("q_group_size")), GROUP_SIZE)
    not_convert = _names(config_file, quantization.get("modules_to_not_convert"), "modules_to_not_convert")
    if method == "awq":
        _need(config_file, "version", str(quantization.get("version", "gemm")).lower(), "gemm")
        _need(config_file, "zero_point", quantization.get("zero_point", True), True)
        return method, False, False, not_convert
    fmt = quantization.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise Int4FormatError(f"{config_file}: quantization_config checkpoint_format {fmt!r} is not supported "
                              "(only 'gptq' or 'gptq_v2')")
    if quantization.get("dynamic"):
        raise Int4FormatError(f"{config_file}: quantization_config dynamic (per-module bits or group sizes) is "
                              "not supported")
    return method, bool(quantization.get("sym", True)), fmt == "gptq", not_convert


def expected_shapes(method: str, symmetric: bool, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """The stored shape of each tensor of one 4-bit layer with N = ``n`` outputs and K = ``k`` inputs (module
    docstring); optional tensors included."""
    g = k // GROUP_SIZE
    if method == "gptq":
        return {".qweight": (k // 8, n), ".qzeros": (g, n // 8), ".scales": (g, n), ".g_idx": (k,)}
    if method == "awq":
        return {".qweight": (k, n // 8), ".qzeros": (g, n // 8), ".scales": (g, n)}
    shapes = {".weight_packed": (n, k // 8), ".weight_scale": (n, g), ".weight_shape": (2,), ".weight_g_idx": (k,)}
    shapes[".weight_zero_point"] = (n, g) if symmetric else (n // 8, g)
    return shapes


def _dims(method: str, shape: Sequence[int]) -> tuple[int, int]:
    """(N, K) of a layer from its marker tensor's shape."""
    if method == "gptq":
        return int(shape[1]), int(shape[0]) * 8
    if method == "awq":
        return int(shape[1]) * 8, int(shape[0])
    return int(shape[0]), int(shape[1]) * 8


_DTYPES = {".qweight": ("I32",), ".qzeros": ("I32",), ".g_idx": ("I32", "I64"), ".weight_packed": ("I32",),
           ".weight_shape": ("I64", "I32"), ".weight_g_idx": ("I32", "I64"), ".scales": SCALE_DTYPES,
           ".weight_scale": SCALE_DTYPES}


def check_int4_tensors(folder: Path, config_file: Path, quantization: Mapping[str, Any],
                       tensors: Mapping[str, tuple[str, Sequence[int]]], shard_of: Mapping[str, str]) -> Int4Spec:
    """Check the 4-bit tensors of a folder against its ``quantization_config`` (``is_int4_config``).

    tensors: name -> (safetensors dtype, shape) from the headers; shard_of: name -> shard file name.  Returns the
    ``Int4Spec``.  Raises Int4FormatError (one line naming the file) for the config problems of
    ``check_int4_config``; no 4-bit layer at all; a layer's tensor missing, of another dtype or shape than the
    format's (a group size other than 128 shows here as a scale of the wrong shape), K not a multiple of 128;
    a layer that also stores a plain ``.weight``; a 4-bit layer that ``modules_to_not_convert`` / ``ignore``
    names.
    """
    from qwen_chat.engine.checkpoints.fp8_format import excluded

    method, symmetric, minus_one, not_convert = check_int4_config(config_file, quantization)
    rows = {n: v for n, v in tensors.items() if not n.startswith(MTP_PREFIX)}
    marker = MARKER[method]
    modules = sorted(n[:-len(marker)] for n in rows if n.endswith(marker))
    if not modules:
        raise Int4FormatError(f"{config_file}: quantization_config says {method} but no shard holds a 4-bit layer "
                              f"(no *{marker} tensor)")
    for module in modules:
        where = folder / shard_of[module + marker]
        n, k = _dims(method, rows[module + marker][1])
        if k % GROUP_SIZE or n % 8:
            raise Int4FormatError(f"{where}: {module}{marker} describes a [{n}, {k}] weight; 4-bit layers need the "
                                  f"input width a multiple of {GROUP_SIZE} and the output width a multiple of 8")
        optional = {".g_idx", ".weight_g_idx"} | ({".weight_zero_point"} if symmetric else set())
        for suffix, shape in expected_shapes(method, symmetric, n, k).items():
            name = module + suffix
            if name not in rows:
                if suffix in optional:
                    continue
                raise Int4FormatError(f"{where}: {module}{marker} is 4-bit ({method}) but its {name} is missing")
            dtype, got = rows[name]
            dtypes = _DTYPES.get(suffix, ("I8", "I32") if symmetric else ("I32",))
            if dtype not in dtypes or tuple(got) != shape:
                raise Int4FormatError(f"{folder / shard_of[name]}: {name} is {dtype} {list(got)}, expected "
                                      f"{' or '.join(dtypes)} {list(shape)} ({method}, {BITS} bits, groups of "
                                      f"{GROUP_SIZE} input columns, for a [{n}, {k}] weight)")
        if module + ".weight" in rows:
            raise Int4FormatError(f"{folder / shard_of[module + '.weight']}: {module} stores both a 4-bit weight and "
                                  "a plain .weight")
        if excluded(module, not_convert):
            raise Int4FormatError(f"{where}: {module} is 4-bit but quantization_config names it among the modules "
                                  "left unquantised (the checkpoint contradicts its config.json)")
    return Int4Spec(method=method, symmetric=symmetric, zeros_minus_one=minus_one, modules=tuple(modules),
                    not_convert=not_convert, config=dict(quantization))


def check_no_int4(folder: Path, tensors: Mapping[str, tuple[str, Sequence[int]]],
                  shard_of: Mapping[str, str]) -> Optional[str]:
    """For a checkpoint without a 4-bit ``quantization_config``: raise Int4FormatError naming the shard when a
    4-bit layer's tensor (``qweight`` or ``weight_packed``) is present anyway; else None."""
    for name in sorted(tensors):
        if not name.startswith(MTP_PREFIX) and name.endswith((".qweight", ".weight_packed")):
            raise Int4FormatError(f"{folder / shard_of[name]}: {name} is a 4-bit layer but {folder / 'config.json'} "
                                  "has no 4-bit quantization_config")
    return None
