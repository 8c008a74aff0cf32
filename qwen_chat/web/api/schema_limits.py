"""How complex the JSON schemas of one request may be (``tools[].function.parameters`` and
``response_format.json_schema.schema`` together), refused with 400 before any grammar is compiled.

A schema is turned into a grammar for constrained decoding (xgrammar); its compile time grows with the schema:
measured on 2 CPU cores (2026-12-01), a string with ``minLength`` 100,000 took 3.6 s and 5,000 required
properties 1.2 s, time the request holds a core.  The limits below keep every legal request well under those:
OpenAI's structured outputs allow at most 5,000 properties and 1,000 enum values per schema (its documented
limits), and 128 tools per request; here the property limit is lower because the grammar is compiled on the
serving machine.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

#: Tools one request may carry (OpenAI's limit).
MAX_TOOLS = 128
#: Objects (subschemas and the objects inside them) in all of a request's schemas together.
MAX_SCHEMA_NODES = 4000
#: Properties (``properties`` entries) in all of a request's schemas together.
MAX_PROPERTIES = 1000
#: ``enum`` values in all of a request's schemas together (OpenAI's limit per schema).
MAX_ENUM_VALUES = 1000
#: Largest ``minLength``, ``maxLength``, ``minItems``, ``maxItems``, ``minProperties`` or ``maxProperties``: a
#: bounded repetition is unrolled into the grammar.
MAX_REPEAT = 10000
REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def schemas_problem(schemas: Iterable[Any]) -> Optional[str]:
    """Why the JSON schemas ``schemas`` (any JSON values: counted as sent, before they are checked against the
    meta-schema; nesting already bounded by the body's depth limit) are too complex together, or None.  The
    message names the limit and what the request has."""
    nodes = properties = enums = 0
    stack = list(schemas)
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        nodes += 1
        if isinstance(node.get("properties"), dict):
            properties += len(node["properties"])
        if isinstance(node.get("enum"), list):
            enums += len(node["enum"])
        for key in REPEAT_KEYS:
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_REPEAT:
                return f"{key} {value:g} is larger than the limit of {MAX_REPEAT}"
        stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
    if properties > MAX_PROPERTIES:
        return f"the schemas have {properties} properties; the limit is {MAX_PROPERTIES}"
    if enums > MAX_ENUM_VALUES:
        return f"the schemas have {enums} enum values; the limit is {MAX_ENUM_VALUES}"
    if nodes > MAX_SCHEMA_NODES:
        return f"the schemas have {nodes} objects; the limit is {MAX_SCHEMA_NODES}"
    return None
