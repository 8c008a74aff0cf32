"""Tool calls and structured output through the OpenAI-compatible API, on the built-in tiny model (random
weights, CPU), driven by the official ``openai`` client over a real uvicorn server.

The random model never chooses to call a tool and rarely closes an unbounded string, so these tests use what
does not depend on the weights: ``tool_choice`` "required" or a named function and ``response_format``
schemas (bounded: ``maxLength``, integer ``minimum``/``maximum``, ``maxItems``, enums), which constrained
decoding must turn into a well-formed call or valid JSON whatever the model prefers.
"""
from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest

from qwen_chat.config import ServiceConfig
from tests.support.servers import serve_engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: loads the tiny model and decodes on CPU

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
BUDGET = {"thinking_token_budget": 8}  # thinking on: the reasoning is closed after 8 tokens

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time",
                                      "parameters": {"type": "object", "properties": {}}}},
]
ARGS_OF = {"get_weather": WEATHER_ARGS, "get_time": TOOLS[1]["function"]["parameters"]}

REPORT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 10},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "level": {"enum": ["low", "mid", "high"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                   "ok": {"type": "boolean"}}, "required": ["id", "ok"]},
    },
    "required": ["title", "score", "level", "tags", "owner"],
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}


@pytest.fixture(scope="module")
def served(tiny_loaded, tmp_path_factory):
    """One server for the module, 8 slots (the batch test fills them)."""
    cfg = ServiceConfig(model="tiny", history_dir=tmp_path_factory.mktemp("history"), max_batch=8, max_queue=8,
                        max_context=2048)
    with serve_engine(tiny_loaded, cfg) as served:
        yield served


@pytest.fixture
def client(served) -> openai.OpenAI:
    url, _ = served
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=240)


def check_calls(calls, names=None) -> list[tuple[str, dict]]:
    """Each call well-formed: an id, a known function, arguments that validate against its schema."""
    assert calls
    out = []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, ARGS_OF[call.function.name])
        out.append((call.function.name, args))
    if names is not None:
        assert {name for name, _ in out} <= set(names)
    return out


def streamed(client, **kwargs):
    """Run a streaming request: (content, finish_reason, [(name, arguments text)] rebuilt from the deltas)."""
    content, finish, calls = "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # the first chunk of a call: index, id, name
                assert d.index not in calls and d.function.name and d.type == "function"
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                calls[d.index][2] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, finish, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("temperature, extra", [(0.0, NO_THINK), (1.0, BUDGET)])
def test_required_tool_call_is_well_formed_streamed_and_not(client, temperature, extra):
    kwargs = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", temperature=temperature,
                  seed=7, max_tokens=300, extra_body=extra)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    whole = check_calls(choice.message.tool_calls)
    assert not (choice.message.content or "").strip()
    content, finish, calls = streamed(client, **kwargs)
    assert finish == "tool_calls" and not content.strip()
    assert [(name, json.loads(args)) for _, name, args in calls] == whole  # same seed, same calls


def test_named_function_is_the_one_called_and_parallel_false_keeps_one(client):
    reply = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, temperature=1.0, seed=3, max_tokens=300, extra_body=BUDGET,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [name for name, _ in check_calls(reply.choices[0].message.tool_calls)] == ["get_weather"]
    assert reply.choices[0].message.reasoning_content is not None
    reply = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=300,
                                           extra_body=NO_THINK)
    assert len(check_calls(reply.choices[0].message.tool_calls)) == 1


def test_the_tool_result_goes_back_and_is_answered(client):
    first = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=300, extra_body=NO_THINK)
    message = first.choices[0].message
    follow_up = USER + [
        {"role": "assistant", "content": message.content,
         "tool_calls": [c.model_dump() for c in message.tool_calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 21})}
          for c in message.tool_calls],
    ]
    reply = client.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS, temperature=0,
                                           max_tokens=16, extra_body=NO_THINK)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the prompt (rendered by the template), the reply is a new turn
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 10
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("temperature, extra", [(0.0, NO_THINK), (1.0, NO_THINK), (0.0, BUDGET), (1.0, BUDGET)])
def test_json_schema_answer_validates(client, temperature, extra):
    kwargs = dict(model="tiny", messages=USER, response_format=SCHEMA_FORMAT, temperature=temperature, seed=11,
                  max_tokens=300, extra_body=extra)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), REPORT)
    if extra is BUDGET:
        assert choice.message.reasoning_content  # the constraint started after the reasoning
        assert reply.usage.completion_tokens_details.reasoning_tokens == 8
    content, finish, _ = streamed(client, **kwargs)
    assert finish == "stop" and content == choice.message.content


def test_json_object_answers_are_objects(client):
    reply = client.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"},
                                           n=8, temperature=1.0, seed=1, max_tokens=200, extra_body=NO_THINK)
    finished = [c for c in reply.choices if c.finish_reason == "stop"]
    assert finished  # with random weights some replies close the object at once, others never do
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    assert all(c.message.content.startswith("{") for c in reply.choices)


def test_unsupported_schema_is_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}})
    assert info.value.param == "response_format" and "missing" in info.value.message


def test_eight_constrained_and_unconstrained_requests_in_one_batch(served, client):
    url, engine = served
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        kind = i % 4
        kwargs = dict(model="tiny", messages=USER, temperature=1.0, seed=100 + i, max_tokens=200,
                      extra_body=NO_THINK if i < 4 else BUDGET)
        if kind == 0:
            kwargs.update(response_format=SCHEMA_FORMAT)
        elif kind == 1:
            kwargs.update(tools=TOOLS, tool_choice="required")
        elif kind == 2:
            kwargs.update(tools=TOOLS)  # auto: the random model answers in text
        else:
            kwargs.update(max_tokens=40)
        try:
            results[i] = client.chat.completions.create(**kwargs)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    before = engine.stats()["max_decode_batch"]
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert len(results) == 8 and not [r for r in results.values() if isinstance(r, Exception)]
    for i, reply in results.items():
        choice = reply.choices[0]
        if i % 4 == 0:
            jsonschema.validate(json.loads(choice.message.content), REPORT)
        elif i % 4 == 1:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls)
        else:
            assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    assert max(before, engine.stats()["max_decode_batch"]) >= 4  # they really shared decode steps
