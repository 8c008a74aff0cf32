"""Grammars for structured output (xgrammar 0.2.8) and the token-mask kernel the sampler applies.

``Grammars`` compiles, for one tokenizer, the grammar of a request's answer (compiled grammars are cached by
xgrammar's compiler, so an agent that sends the same tools every turn compiles them once):

* ``json_schema(schema)``: JSON that matches ``schema`` (OpenAI ``response_format`` ``json_schema``; a
  ``json_object`` is the schema ``{"type": "object"}`` without strict mode).  No free whitespace between JSON
  tokens (``any_whitespace=False``): free whitespace lets a model loop on spaces and newlines inside the JSON.
  Strict mode for schemas (xgrammar's ``strict_mode``): properties and items the schema does not declare are
  never generated, so the output always validates;
* ``tool_calls(tools, forced, parallel)``: one or more calls in Qwen3.5's own format, exactly as the chat
  template writes them (``<tool_call>`` id, ``\\n<function=NAME>\\n``, one ``<parameter=ARG>\\nVALUE\\n
  </parameter>\\n`` per argument in the schema's order, required ones always, ``</function>\\n``, the
  ``</tool_call>`` id; calls separated by a newline), with each VALUE following the argument's schema: a
  string argument is raw text (never containing ``</parameter>``; one with ``minLength``/``maxLength`` has
  no ``<`` either, so that a regular expression counts its characters; an ``enum``/``const`` is one of its
  strings, a ``pattern`` a regular-expression match), any other argument is
  JSON for its schema (no free whitespace).  ``$defs``/``definitions`` of the parameters schema reach every
  argument.  Arguments whose types mix strings with other types are generated as raw text;
* ``or_tool_calls(json, tools, parallel)``: either of the two (``response_format`` with ``tool_choice`` auto).

Vocabulary: the tokenizer's regular tokens keep their text; control tokens (``<think>``, ``<|im_start|>``...)
and the embedding's padding rows can never be generated under a grammar, except the stop ids (where the
grammar may end) and ``<tool_call>``/``</tool_call>``, which only a tool-call grammar places (their text
starts and ends with a NUL byte, which neither JSON strings nor raw string arguments may contain).

Raises ``InvalidInput`` (HTTP 400) naming the request field when xgrammar cannot compile a schema.
"""
from __future__ import annotations

import json
import logging
from typing import Optional, Sequence

import torch
import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    GrammarFormat,
    OptionalFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TokenFormat,
)

from qwen_chat.chat_types import InvalidInput, ToolSpec
from qwen_chat.engine.text.toolcalls import json_types

log = logging.getLogger(__name__)

#: Text of the NUL byte in a byte-level BPE vocabulary (GPT-2's byte table maps byte 0 to U+0100).
_NUL = "\u0100"
_PARAM_END = "\n</parameter>\n"


#: xgrammar 0.2.8 writes the characters of a length-bounded JSON string as ``[^\"\\\r\n]``, which lets raw
#: control characters (a tab, U+0000-U+001F) into the string: JSON forbids them (``json.loads`` refuses such
#: text).  ``json_ebnf`` narrows the class to the one its unbounded strings use.
_BOUNDED_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'


def json_ebnf(schema: dict, *, strict: bool = True) -> str:
    """The EBNF grammar of JSON matching ``schema`` without free whitespace (xgrammar's conversion, with
    bounded strings' characters narrowed to what JSON allows).  Raises what xgrammar raises (RuntimeError)."""
    text = json.dumps(schema, ensure_ascii=False)
    ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict))
    return ebnf.replace(_BOUNDED_CHARS, _JSON_CHARS)


class Grammars:
    """xgrammar's tokenizer view and compiler for one tokenizer (see the module docstring).  Thread-safe.

    Args:
        tokenizer: a Hugging Face byte-level BPE tokenizer (``get_vocab``, ``get_added_vocab``).
        vocab_size: width of the model's logits (Qwen3.5: 248,320, more than the tokenizer's 248,077).
        stop_ids: ids that end a reply (``<|endoftext|>``, ``<|im_end|>``).
        tool_ids: ``(<tool_call>, </tool_call>)`` ids, or None when the tokenizer has none.
    Building it reads the whole vocabulary (about 1 s for Qwen3.5's).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int],
                 tool_ids: Optional[tuple[int, int]] = None) -> None:
        control = set(tokenizer.get_added_vocab().values())
        encoded = [""] * int(vocab_size)
        for text, tid in tokenizer.get_vocab().items():
            if tid < vocab_size and tid not in control:
                encoded[tid] = text
        self.tool_ids = tool_ids
        if tool_ids is not None:
            encoded[tool_ids[0]] = f"{_NUL}<tool_call>{_NUL}"
            encoded[tool_ids[1]] = f"{_NUL}</tool_call>{_NUL}"
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=int(vocab_size),
                                      stop_token_ids=[int(t) for t in stop_ids])
        self.compiler = xgr.GrammarCompiler(self.info)

    def json_schema(self, schema: dict, *, strict: bool = True, param: str = "response_format"
                    ) -> xgr.CompiledGrammar:
        """The compiled grammar of JSON matching ``schema``.  Raises InvalidInput (``param``)."""
        try:
            return self.compiler.compile_grammar(json_ebnf(schema, strict=strict))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidInput(f"{param}: the JSON schema cannot be enforced: {exc}", param=param) from None

    def tool_calls(self, tools: Sequence[ToolSpec], *, forced: Optional[str] = None,
                   parallel: bool = True) -> xgr.CompiledGrammar:
        """The compiled grammar of at least one call of ``tools`` (only ``forced`` when given, then exactly one
        call; one at most unless ``parallel``).  Raises InvalidInput (``tools``)."""
        return self._structural(self._calls(tools, forced, parallel))

    def or_tool_calls(self, schema: dict, tools: Sequence[ToolSpec], *, parallel: bool = True
                      ) -> xgr.CompiledGrammar:
        """The compiled grammar of JSON matching ``schema`` or of tool calls (``tool_calls``)."""
        json_part = self._json_format(schema, "response_format")
        return self._structural(OrFormat(elements=[json_part, self._calls(tools, None, parallel)]))

    # ---- building the formats --------------------------------------------------------------------------
    def _structural(self, fmt) -> xgr.CompiledGrammar:
        try:
            return self.compiler.compile_structural_tag(StructuralTag(format=fmt))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidInput(f"tools: the calls cannot be enforced: {exc}", param="tools") from None

    def _calls(self, tools: Sequence[ToolSpec], forced: Optional[str], parallel: bool):
        if self.tool_ids is None:
            raise InvalidInput("tools: this model's tokenizer has no <tool_call> token", param="tools")
        chosen = [t for t in tools if forced is None or t.name == forced]
        tags = [self._call(i, t) for i, t in enumerate(chosen)]
        return TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                       stop_after_first=forced is not None or not parallel)

    def _call(self, index: int, tool: ToolSpec) -> TagFormat:
        params = tool.parameters if isinstance(tool.parameters, dict) else {}
        properties = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or [])
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        parts: list = [ConstStringFormat(value=f"\n<function={tool.name}>\n")]
        for name, schema in properties.items():
            where = f"tools[{index}].function.parameters.properties.{name}"
            sub = {**schema, **defs} if isinstance(schema, dict) else schema
            tag = TagFormat(begin=f"<parameter={name}>\n", content=self._value(sub, where), end=_PARAM_END)
            parts.append(tag if name in required else OptionalFormat(content=tag))
        parts.append(ConstStringFormat(value="</function>\n"))
        open_id, close_id = self.tool_ids
        return TagFormat(begin=TokenFormat(token=open_id), content=SequenceFormat(elements=parts),
                         end=TokenFormat(token=close_id))

    def _value(self, schema, where: str):
        """The format of one argument's VALUE (see the module docstring)."""
        kinds = json_types(schema)
        if "string" not in kinds:
            return self._json_format(schema if isinstance(schema, dict) else {}, where)
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return OrFormat(elements=[ConstStringFormat(value=v) for v in values])
        if kinds == ["string"] and isinstance(schema.get("pattern"), str):
            return RegexFormat(pattern=schema["pattern"])
        low, top = (int(schema.get("minLength") or 0), schema.get("maxLength")) if kinds == ["string"] else (0, None)
        if low or top is not None:  # counted in characters of valid UTF-8 by a regular expression
            return RegexFormat(pattern=f"[^<\\x00]{{{low},{'' if top is None else int(top)}}}")
        return AnyTextFormat(excludes=["</parameter>", "\x00"])

    def _json_format(self, schema: dict, where: str) -> GrammarFormat:
        try:
            ebnf = json_ebnf(schema)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidInput(f"{where}: the JSON schema cannot be enforced: {exc}",
                               param=where.split(".", 1)[0].split("[", 1)[0]) from None
        return GrammarFormat(grammar=ebnf)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with -inf at every token a grammar forbids; a new tensor (the input is left as it is, for
    the log-probabilities of the raw distribution).

    logits: float [B, V]; bitmask: int32 [B, ceil(V / 32)] on the same device, bit j of word w set when token
    32 w + j is allowed (xgrammar's layout; a row of all ones, -1, leaves its row unchanged).
    """
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :logits.shape[1]]
    return logits.masked_fill(allowed == 0, float("-inf"))
