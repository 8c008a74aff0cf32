"""Tool calls in the model's output: Qwen3.5's call format -> ``ToolCall``s, and tools for the chat template.

Qwen3.5 calls a function in the form its chat template teaches (docs/facts.md, "Chat template behaviour")::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

where ``<tool_call>`` and ``</tool_call>`` are single special tokens (248058 / 248059, docs/facts.md,
"Tokens").  ``ToolCallSplitter`` works on token ids, so only those two ids open and close a call: text the
model writes that merely looks like ``<tool_call>`` (ordinary tokens, e.g. quoting a user) stays text.

Rules of ``parse_call`` (the body between the two ids):

* the body is ``<function=NAME>`` followed by ``<parameter=ARG>VALUE</parameter>`` blocks and ``</function>``,
  with only whitespace between them; NAME must be one of the request's tools.  One newline right after
  ``<parameter=ARG>`` and one right before ``</parameter>`` belong to the format (the template writes
  them) and are removed, as vLLM's ``qwen3_coder`` parser does;
* VALUE is typed by the tool's JSON schema for ARG: a string schema keeps the text as it is; integer, number,
  boolean, null, object and array values are read as JSON (``True``/``False`` too for booleans); a value that
  does not read as its type, a parameter the schema does not declare, and a schema without a type keep
  (or, for a schema without a type, try JSON first and then keep) the text;
* the older JSON form ``{"name": ..., "arguments": {...}}`` inside the tags is accepted as well;
* anything else is malformed: the whole call, tags included, goes back into the answer as plain text and
  a warning is logged (never an error for the client).

``arguments`` is the JSON text of the typed values (``json.dumps``, non-ASCII kept), so it parses back to
the same object; ``ToolCall.id`` is ``call_`` + 24 hex digits.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Callable, Optional, Sequence

from qwen_chat.chat_types import InvalidInput, ToolCall, ToolSpec

log = logging.getLogger(__name__)

#: ``<tool_call>`` / ``</tool_call>`` in the Qwen3.5 tokenizer (docs/facts.md, "Tokens").
TOOL_CALL_ID = 248058
TOOL_CALL_END_ID = 248059

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_FUNCTION_END = re.compile(r"\s*</function>\s*\Z")
_MISSING = object()


def new_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def json_types(schema: Any) -> list[str]:
    """The JSON types a (sub)schema allows, from ``type``, ``enum``/``const`` values and ``anyOf``/``oneOf``
    members, in a fixed order (string, integer, number, boolean, null, object, array); [] when it does not
    say."""
    if not isinstance(schema, dict):
        return []
    found: list[str] = []
    kind = schema.get("type")
    for k in ([kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []):
        found.append(str(k))
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    for value in values if isinstance(values, list) else []:
        found.append({str: "string", bool: "boolean", int: "integer", float: "number", dict: "object",
                      list: "array", type(None): "null"}.get(type(value), "string"))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found.extend(json_types(sub))
    order = ("string", "integer", "number", "boolean", "null", "object", "array")
    return [k for k in order if k in found]


def typed_value(text: str, schema: Any) -> Any:
    """One parameter's text as the value its JSON schema asks for (see the module docstring).

    ``schema``: the parameter's schema, or ``_MISSING`` for a parameter the tool does not declare (kept as
    text).  Never raises."""
    if schema is _MISSING:
        return text
    kinds = json_types(schema)
    stripped = text.strip()
    try:
        value = json.loads(stripped)
    except ValueError:
        value = _MISSING
    if not kinds:
        return text if value is _MISSING else value
    if "string" in kinds and not (stripped == "null" and "null" in kinds):
        return text
    for kind in kinds:
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind == "null" and value is None:
            return None
        if kind == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and float(value).is_integer():
            return int(value)
        if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if (kind, type(value)) in (("object", dict), ("array", list)):
            return value
    return text


def _strip_format_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def parse_call(body: str, tools: Sequence[ToolSpec]) -> tuple[Optional[tuple[str, dict]], str]:
    """Read the text between ``<tool_call>`` and ``</tool_call>``: ``((name, arguments), "")`` or
    ``(None, why)`` when it is malformed (see the module docstring).  Never raises."""
    by_name = {t.name: t for t in tools}
    if body.strip().startswith("{"):
        try:
            obj = json.loads(body)
        except ValueError:
            return None, "JSON form that is not valid JSON"
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None, "arguments that are not JSON"
        if not isinstance(name, str) or not isinstance(args, dict):
            return None, "JSON form without a name and an arguments object"
        if name not in by_name:
            return None, f"unknown function {name!r}"
        return (name, args), ""
    head = _FUNCTION.match(body)
    if head is None:
        return None, "no <function=...> line"
    name = head.group(1).strip()
    if name not in by_name:
        return None, f"unknown function {name!r}"
    properties = by_name[name].parameters.get("properties") or {}
    args: dict = {}
    pos = head.end()
    while (param := _PARAMETER.match(body, pos)) is not None:
        key = param.group(1).strip()
        args[key] = typed_value(_strip_format_newlines(param.group(2)),
                                properties.get(key, _MISSING) if isinstance(properties, dict) else _MISSING)
        pos = param.end()
    if _FUNCTION_END.match(body, pos) is None:
        return None, "text that is not a <parameter=...> block, or no </function>"
    return (name, args), ""


class ToolCallSplitter:
    """Takes a reply's answer ids one at a time and keeps the tool calls apart from the text.

    Args:
        tools: the request's tools (names and parameter schemas).
        token_bytes: ``id -> bytes`` of one token (a special id as its name), e.g. from
            ``ReplyDecoder.token_piece``.
        parallel: False keeps the first call only (OpenAI ``parallel_tool_calls``); later ones are dropped,
            with a log line.
        open_id / close_id: ``<tool_call>`` / ``</tool_call>``.

    ``feed`` returns the ids that are answer text (usually the id itself; nothing while a call is open; the
    whole call, tags included, when it turned out malformed); ``flush`` at the end of the reply returns a call
    left open (cut off by the token limit) as text.  ``calls``: the ``ToolCall``s parsed so far.
    """

    def __init__(self, tools: Sequence[ToolSpec], token_bytes: Callable[[int], bytes], *, parallel: bool = True,
                 open_id: int = TOOL_CALL_ID, close_id: int = TOOL_CALL_END_ID) -> None:
        self.tools = tuple(tools)
        self.token_bytes = token_bytes
        self.parallel = parallel
        self.open_id, self.close_id = int(open_id), int(close_id)
        self.calls: list[ToolCall] = []
        self._held: Optional[list[int]] = None

    @property
    def in_call(self) -> bool:
        """True between a ``<tool_call>`` and its ``</tool_call>``."""
        return self._held is not None

    def feed(self, token: int) -> list[int]:
        """One answer id in; the ids that are text out (see the class docstring)."""
        token = int(token)
        if self._held is None:
            if token == self.open_id:
                self._held = [token]
                return []
            return [token]
        if token == self.open_id:  # a new call before this one closed: this one was not a call
            text, self._held = self._held, [token]
            self._malformed(text, "a second <tool_call> before </tool_call>")
            return text
        self._held.append(token)
        if token != self.close_id:
            return []
        held, self._held = self._held, None
        parsed, why = parse_call(self._text(held[1:-1]), self.tools)
        if parsed is None:
            self._malformed(held, why)
            return held
        if self.calls and not self.parallel:
            log.info("dropped a second tool call (parallel_tool_calls is false): %s", parsed[0])
            return []
        name, args = parsed
        self.calls.append(ToolCall(id=new_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False)))
        return []

    def flush(self) -> list[int]:
        """End of the reply: the ids of a call that never closed (they are text), else []."""
        held, self._held = self._held, None
        if held is None:
            return []
        self._malformed(held, "the reply ended inside the call")
        return held

    def _text(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")

    def _malformed(self, ids: Sequence[int], why: str) -> None:
        log.warning("tool call not understood (%s); it is returned as text: %r", why, self._text(ids)[:300])


def template_tools(tools: Sequence[ToolSpec]) -> list[dict]:
    """The tools as the chat template reads them: OpenAI's ``{"type": "function", "function": {...}}``."""
    out = []
    for t in tools:
        function: dict = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = t.parameters
        out.append({"type": "function", "function": function})
    return out


def template_tool_calls(calls: Sequence[ToolCall]) -> list[dict]:
    """An assistant message's calls as the template reads them: ``arguments`` as an object (the template
    iterates over its items), not as JSON text.  Raises InvalidInput when ``arguments`` is not a JSON object."""
    out = []
    for call in calls:
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise InvalidInput(f"the arguments of tool call {call.id!r} are not a JSON object")
        out.append({"type": "function", "id": call.id, "function": {"name": call.name, "arguments": args}})
    return out


def check_no_control_text(texts: Sequence[tuple[str, str]], control: Sequence[str]) -> None:
    """Refuse tool text that would become a control token in the prompt (it is rendered by the template, not
    as message text).  ``texts``: (where, text) pairs; ``control``: the tokenizer's special-token strings.

    Raises: InvalidInput naming where and which token (param ``tools`` or ``messages``)."""
    for where, text in texts:
        for token in control:
            if token and token in text:
                raise InvalidInput(f"{where} contains {token!r}, a control token of the model; remove it",
                                   param=where.split("[", 1)[0].split(".", 1)[0])
