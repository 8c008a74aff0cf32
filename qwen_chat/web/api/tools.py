"""The API's tool calling and structured output: reading ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``response_format`` and the tool parts of ``messages``; writing ``message.tool_calls`` and the streamed
``delta.tool_calls``.

Accepted (everything else in these fields is a 400 naming the field):

* ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]``;
  names of 1-64 characters from ``A-Z a-z 0-9 _ - . :``; ``parameters`` a JSON schema of an object (checked
  with ``jsonschema``'s meta-schema); at most 128 tools, and the schemas of a request within the complexity
  limits of ``schema_limits`` (properties, enum values, repetition bounds), else 400 before any grammar is built.  ``functions`` / ``function_call`` (the deprecated form) are refused by
  ``protocol`` (code ``unsupported_parameter``).
* ``tool_choice``: ``"auto"`` (default), ``"none"`` (the tools are not shown to the model), ``"required"``,
  or ``{"type": "function", "function": {"name": NAME}}``; the last two are enforced by constrained
  decoding (``qwen_chat.engine.core.constraints``).  ``parallel_tool_calls``: true (default) or false.
* ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}``, enforced during sampling.
* ``messages``: an assistant message may carry ``tool_calls`` (``[{"id", "type": "function", "function":
  {"name", "arguments": JSON object text}}]``, content may be null); a ``tool`` message (``tool_call_id``,
  text content) must follow such an assistant message or another tool message.

Replies: ``message.tool_calls`` (``content`` null when the model wrote no text besides the calls) with
``finish_reason`` "tool_calls"; streamed as ``delta.tool_calls`` chunks, per call first ``index``, ``id``,
``type`` and ``function.name`` (arguments ""), then the arguments in fragments (one per argument) that
concatenate to ``function.arguments``.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from qwen_chat.chat_types import ChatMessage, InvalidInput, StreamUpdate, ToolCall, ToolSpec
from qwen_chat.web.api.schema_limits import MAX_TOOLS, schemas_problem

#: Function names the call format can carry (OpenAI's ``[a-zA-Z0-9_-]{1,64}``, plus ``.`` and ``:`` that MCP
#: tool names use); never ``>`` or a newline, which would end ``<function=NAME>``.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _bad(param: str, message: str) -> InvalidInput:
    return InvalidInput(f"{param}: {message}", param=param)


def _unicode(value: Any, param: str) -> None:
    """Refuse strings with a lone UTF-16 surrogate anywhere in ``value`` (they cannot be tokenized)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(param, "contains a lone UTF-16 surrogate, which is not valid Unicode text") from None


def _schema(schema: Any, param: str, *, object_only: bool) -> dict:
    """A JSON schema from the request, checked against its meta-schema (jsonschema)."""
    if not isinstance(schema, dict):
        raise _bad(param, "must be a JSON schema (an object)")
    _unicode(schema, param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise _bad(param, f"is not a valid JSON schema: {exc.message}") from None
    if object_only and schema.get("type", "object") != "object":
        raise _bad(param, "must describe an object (\"type\": \"object\")")
    return schema


def _tool(raw: Any, param: str) -> ToolSpec:
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise InvalidInput(f"{param}: only tools of type \"function\" are supported", param=param)
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{param}.function", "must be an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _bad(f"{param}.function.name", "must be 1-64 characters from A-Z, a-z, 0-9, _, -, ., :")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise _bad(f"{param}.function.description", "must be a string")
    _unicode(description, f"{param}.function.description")
    params = fn.get("parameters")
    params = {} if params is None else _schema(params, f"{param}.function.parameters", object_only=True)
    return ToolSpec(name=name, description=description, parameters=params)


def tool_settings(body: dict) -> dict:
    """The ``GenerationSettings`` fields of a request's tool and format fields (``tools``, ``tool_choice``,
    ``forced_tool``, ``parallel_tool_calls``, ``json_schema``).  Raises InvalidInput (400) naming the field."""
    out: dict[str, Any] = {}
    raw_tools = body.get("tools")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise _bad("tools", "must be a list of tools")
    if raw_tools is not None and len(raw_tools) > MAX_TOOLS:
        raise _bad("tools", f"has {len(raw_tools)} tools; the limit is {MAX_TOOLS}")
    fmt = body.get("response_format")
    # Counted on the request as sent, before the meta-schema check (seconds for 5,000 properties) or a grammar.
    problem = schemas_problem([raw_tools, fmt])
    if problem:
        raise _bad("tools" if raw_tools else "response_format", f"the JSON schemas are too complex: {problem}")
    if raw_tools is not None:
        out["tools"] = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw_tools))
    names = {t.name for t in out.get("tools", ())}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _bad("tool_choice", f"no tool is named {name!r}")
        out.update(tool_choice="required", forced_tool=name)
    elif choice in ("auto", "none", "required"):
        if choice == "required" and not names:
            raise _bad("tool_choice", "\"required\" needs tools")
        out["tool_choice"] = choice
    elif choice is not None:
        raise _bad("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": '
                                  '{"name": ...}}')
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _bad("parallel_tool_calls", "must be true or false")
        out["parallel_tool_calls"] = parallel
    out.update(_format(fmt))
    return out


def _format(fmt: Any) -> dict:
    """The ``json_schema`` setting of ``response_format`` (empty for none or "text")."""
    out: dict[str, Any] = {}
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            out["json_schema"] = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise _bad("response_format.json_schema", "must be an object with a \"schema\"")
            out["json_schema"] = _schema(spec["schema"], "response_format.json_schema.schema", object_only=False)
        elif kind != "text":
            raise InvalidInput("response_format: the type must be \"text\", \"json_object\" or \"json_schema\"",
                               param="response_format")
    return out


def message_tool_calls(msg: dict, role: str, where: str) -> tuple[ToolCall, ...]:
    """The ``tool_calls`` of one request message (assistant messages only).  Raises InvalidInput (400)."""
    raw = msg.get("tool_calls")
    if not raw:
        return ()
    if role != "assistant" or not isinstance(raw, list):
        raise _bad(f"{where}.tool_calls", "only an assistant message carries tool_calls, as a list")
    calls = []
    for j, item in enumerate(raw):
        param = f"{where}.tool_calls[{j}]"
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
            raise _bad(param, "must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(f"{param}.function.arguments", "is not valid JSON") from None
        if not isinstance(args, dict):
            raise _bad(f"{param}.function.arguments", "must be a JSON object")
        _unicode(args, f"{param}.function.arguments")
        call_id = item.get("id") if isinstance(item.get("id"), str) else f"call_{j}"  # the template ignores ids
        calls.append(ToolCall(id=call_id, name=fn["name"], arguments=json.dumps(args, ensure_ascii=False)))
    return tuple(calls)


def check_tool_turns(messages: Sequence[ChatMessage], shift: int) -> None:
    """Refuse a ``tool`` message that follows neither an assistant message with ``tool_calls`` nor another
    tool message (``shift``: request index minus list index, after leading system messages were merged)."""
    for i, message in enumerate(messages):
        if message.role != "tool":
            continue
        before = messages[i - 1] if i else None
        if before is None or not (before.role == "tool" or (before.role == "assistant" and before.tool_calls)):
            raise _bad(f"messages[{i + shift}].role", "a tool message must follow an assistant message with "
                                                      "tool_calls (or another tool message)")


def call_body(call: ToolCall) -> dict:
    """OpenAI's ``tool_calls[i]`` object of one call."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def message_tool_fields(last: Optional[StreamUpdate]) -> dict:
    """The fields a non-streamed ``message`` gets from a reply that made calls: ``tool_calls`` and ``content``
    (null when the model wrote no text besides them); {} for a reply without calls."""
    if last is None or not last.tool_calls:
        return {}
    return {"content": last.answer or None, "tool_calls": [call_body(c) for c in last.tool_calls]}


def argument_fragments(arguments: str) -> list[str]:
    """``arguments`` (a JSON object as text) in pieces that concatenate to it: ``{`` with the first argument,
    then each further argument; the whole text when it cannot be split that way."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return [arguments]
    if not isinstance(args, dict) or not args:
        return [arguments]
    items = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in args.items()]
    pieces = ["{" + items[0]] + [", " + item for item in items[1:]]
    pieces[-1] += "}"
    return pieces if "".join(pieces) == arguments else [arguments]


def tool_call_deltas(calls: Sequence[ToolCall], sent: int) -> list[dict]:
    """The chunk deltas of the calls after the first ``sent``: per call a delta with ``index``, ``id``,
    ``type`` and ``function.name``, then one per argument fragment (``argument_fragments``)."""
    deltas = []
    for index, call in enumerate(calls[sent:], start=sent):
        deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        for piece in argument_fragments(call.arguments):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return deltas
