"""Prompt building: chat messages + images -> token ids and vision inputs, ready for prefill.

Pure: no model, no device; only the checkpoint's processor (tokenizer, image processor, chat template).

How the ids are made (``build_prompt``):
1. The checkpoint's own chat template is rendered with every message text replaced by a unique sentinel
   string, so the template decides the turn layout (ChatML, ``<|vision_start|><|image_pad|><|vision_end|>``
   per image, the thinking pre-fill, no reasoning from earlier turns).
2. The rendered string is split on the sentinels.  Template pieces are encoded normally (their special
   tokens become control ids); message texts are encoded with ``split_special_tokens=True``, so text that
   looks like ``<|im_start|>``, ``<|im_end|>``, ``<|image_pad|>``, ``<|endoftext|>`` or ``<think>`` stays
   ordinary text: no control id ever comes from a message.
3. Each ``<|image_pad|>`` id is expanded, in order, to the image's number of visual tokens,
   ``grid_t * grid_h * grid_w / merge_size**2`` (one per 32x32 px block), as ``Qwen3VLProcessor`` does.
For ordinary text the ids equal what ``processor.apply_chat_template`` + ``processor(...)`` give for the same
messages (tests/unit/test_prompt.py checks this).  Because the template only ever sees the sentinels, the text
transformations it would apply are done here, exactly as the tiny model's template does them: each content
is trimmed (only on the right when images precede the text) and an assistant text keeps only what follows
its last ``</think>``.  ``ChatMessage.reasoning`` is never sent back to the model (docs/facts.md, "Chat
template behaviour").  With a checkpoint whose template does not trim, only whitespace around a message can
differ from its own ids.

Images: each path is opened with Pillow (the files are already normalised RGB, see ``qwen_chat.images``)
and run through the image processor with ``longest_edge = image_token_budget * 1024`` pixels (docs/facts.md,
"Images": ``smart_resize`` keeps the pixel count in [shortest_edge, longest_edge], one visual token per 1024 px) and
``shortest_edge = min(processor default, longest_edge / 4)`` (so rounding up never overshoots the budget).

Context policy (prompt tokens + max_new_tokens must fit ``context_length``):
1. If they do not fit, drop the oldest whole turns (a user message with the assistant replies that follow
   it) until they fit.  Turns are never cut in the middle, so an image's tokens are never split; the system
   prompt and the latest user turn are never dropped.
2. If the prompt alone still leaves less than ``max_new_tokens``, clamp ``max_new_tokens`` to what is left,
   but not below 64 (the lower end of ``chat_types.MAX_NEW_TOKENS_RANGE``) or the ``max_new_tokens`` asked
   for, whichever is smaller.
3. If even that does not fit, raise ``ContextTooLong`` with the token counts.
``PreparedPrompt.notice`` tells the user what was dropped (how many turns, how many tokens) or clamped;
``PreparedPrompt.dropped_messages`` counts the messages left out.

Tools: the request's tools, the assistant messages' ``tool_calls`` and the ``tool`` messages are given to the
template, which renders them (docs/facts.md, "Chat template behaviour"; tool results are message text behind
sentinels like any content).  Tool definitions and calls become template text, so they must not contain a
control token's string (refused).  A turn is a user message and everything after it up to the next user
message, so a tool loop's messages stay with their question.
"""
from __future__ import annotations

import json
import secrets
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from PIL import Image, UnidentifiedImageError

from qwen_chat.chat_types import (
    MAX_NEW_TOKENS_RANGE,
    ChatMessage,
    ContextTooLong,
    InvalidImage,
    InvalidInput,
    ToolSpec,
    conversation_problem,
)
from qwen_chat.engine.types import PreparedPrompt
from qwen_chat.engine.text.text_ids import shared_prefix, system_prefix, text_ids
from qwen_chat.engine.text.toolcalls import check_no_control_text, template_tool_calls, template_tools

#: Pixels per visual token: one token per 32 x 32 px block (16 px patches, 2 x 2 merge; docs/facts.md,
#: "Images").
PIXELS_PER_VISUAL_TOKEN = 1024

#: Smallest reply the context policy leaves room for (tokens).
MIN_NEW_TOKENS = MAX_NEW_TOKENS_RANGE[0]

IMAGE_PAD = "<|image_pad|>"
THINK_END = "</think>"


@dataclass
class _Turn:
    """Messages of one turn: a user message and the assistant replies after it."""

    messages: list[ChatMessage]


@dataclass
class _Encoded:
    ids: list[int]
    image_paths: list[str]
    image_token_counts: list[int]
    turn_tokens: list[int]  # tokens attributed to each turn (index 0 = system, if any, else first turn)


def _processor_of(loaded_or_processor: Any) -> Any:
    return getattr(loaded_or_processor, "processor", loaded_or_processor)


def _content_text(message: ChatMessage) -> str:
    """The text the template would end up showing for this message (trim, and for an assistant only the
    part after the last ``</think>``), so that a sentinel can stand in for it."""
    text = message.text
    text = text.rstrip() if message.images else text.strip()
    if message.role == "assistant" and THINK_END in text:
        text = text.split(THINK_END)[-1].lstrip("\n")
    return text


def _validate(messages: Sequence[ChatMessage]) -> None:
    problem = conversation_problem(messages)
    if problem is not None:
        raise InvalidInput(problem[2])


def _split_turns(messages: Sequence[ChatMessage]) -> tuple[Optional[ChatMessage], list[_Turn]]:
    system = messages[0] if messages[0].role == "system" else None
    turns: list[_Turn] = []
    for message in messages[1:] if system else messages:
        if message.role == "user" or not turns:
            turns.append(_Turn([message]))
        else:
            turns[-1].messages.append(message)
    return system, turns


def _image_kwargs(image_processor: Any, image_token_budget: int) -> dict:
    if image_token_budget < 1:
        raise InvalidInput(f"image_token_budget must be at least 1, got {image_token_budget}")
    longest = int(image_token_budget) * PIXELS_PER_VISUAL_TOKEN
    default_shortest = int(image_processor.size["shortest_edge"])
    # The lower bound must stay well below the cap: smart_resize rounds *up* (ceil) when it enlarges an image to
    # shortest_edge, which with shortest_edge == longest_edge (budgets <= 64 tokens with the 65536 px default)
    # overshoots the budget (a 600x400 photo came out at 72 tokens for a 64-token budget).
    return {"size": {"shortest_edge": min(default_shortest, longest // 4), "longest_edge": longest}}


def _open_image(path: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise InvalidImage(f"Cannot read image {Path(path).name}: {exc}") from exc


def _visual_tokens(image_processor: Any, path: str, kwargs: dict) -> int:
    """Number of visual tokens of one image, from its size alone (no pixel processing)."""
    try:
        with Image.open(path) as image:
            width, height = image.size
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise InvalidImage(f"Cannot read image {Path(path).name}: {exc}") from exc
    size = kwargs["size"]
    try:
        patches = image_processor.get_number_of_image_patches(
            height, width, {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]})
    except ValueError as exc:  # smart_resize refuses aspect ratios above 200
        raise InvalidImage(f"Image {Path(path).name} ({width}x{height}) cannot be used: {exc}") from exc
    return int(patches) // int(image_processor.merge_size) ** 2


def _conversation(system: Optional[ChatMessage], turns: Sequence[_Turn], sentinel: str) -> tuple[list[dict], list]:
    """Template messages with sentinels for texts; also, per sentinel, (turn index, message) in order."""
    conversation: list[dict] = []
    owners: list = []
    flat = ([(-1, system)] if system else []) + [(i, m) for i, t in enumerate(turns) for m in t.messages]
    for turn_index, message in flat:
        entry: dict = {"role": message.role, "content": ""}
        if message.tool_calls:
            entry["tool_calls"] = template_tool_calls(message.tool_calls)
        if message.images or _content_text(message) or not message.tool_calls:  # the template tests "content"
            marker = f"{sentinel}{len(owners)}{sentinel}"
            owners.append((turn_index, message))
            entry["content"] = [{"type": "image"} for _ in message.images] + [{"type": "text", "text": marker}]
        conversation.append(entry)
    return conversation, owners


#: Serialises ``_encode``: transformers keeps ``split_special_tokens`` as a setting of the shared backend
#: tokenizer (``encode_special_tokens``, set on each call), so two threads encoding at once (the API's worker
#: threads) could each encode with the other's setting: template control tokens split into text, or message
#: text read as control tokens (4 wrong prompts in 600 concurrent requests; measured: docs/performance.md).
_ENCODE_LOCK = threading.Lock()


def _encode(processor: Any, system: Optional[ChatMessage], turns: Sequence[_Turn], enable_thinking: bool,
            image_tokens: dict[str, int], tools: Optional[list[dict]] = None) -> _Encoded:
    with _ENCODE_LOCK:
        return _encode_locked(processor, system, turns, enable_thinking, image_tokens, tools)


def _encode_locked(processor: Any, system: Optional[ChatMessage], turns: Sequence[_Turn],
                   enable_thinking: bool, image_tokens: dict[str, int], tools: Optional[list[dict]]) -> _Encoded:
    tokenizer = processor.tokenizer
    sentinel = f"\x00QCS{secrets.token_hex(8)}\x00"
    for turn in turns:
        for message in turn.messages:
            if sentinel in message.text:  # practically impossible (random, with NUL bytes), but checked
                raise InvalidInput("Message text contains reserved control characters.")
    conversation, owners = _conversation(system, turns, sentinel)
    chat_template = getattr(processor, "chat_template", None) or tokenizer.chat_template
    rendered = tokenizer.apply_chat_template(
        conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=True,
        enable_thinking=enable_thinking, tools=tools)
    pieces = rendered.split(sentinel)
    # pieces: template, index, template, index, ..., template
    if len(pieces) != 2 * len(owners) + 1:
        raise RuntimeError("The chat template dropped or repeated a message; cannot build the prompt safely.")

    image_pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    special_ids = set(tokenizer.all_special_ids) | set(
        tid for tid in tokenizer.added_tokens_decoder if tokenizer.added_tokens_decoder[tid].special)
    n_turn_slots = len(turns) + (1 if system else 0)
    offset = 1 if system else 0
    turn_tokens = [0] * n_turn_slots
    ids: list[int] = []
    image_paths: list[str] = []
    counts: list[int] = []
    pending_images: list[str] = []

    def add_template(text: str, slot: int) -> None:
        for token in tokenizer.encode(text, add_special_tokens=False):
            if token == image_pad_id:
                if not pending_images:
                    raise RuntimeError("The chat template has more image slots than the messages have images.")
                path = pending_images.pop(0)
                n = image_tokens[path]
                ids.extend([image_pad_id] * n)
                image_paths.append(path)
                counts.append(n)
                turn_tokens[slot] += n
            else:
                ids.append(token)
                turn_tokens[slot] += 1

    for index, (turn_index, message) in enumerate(owners):
        slot = turn_index + offset
        pending_images.extend(message.images)
        add_template(pieces[2 * index], slot)
        if pieces[2 * index + 1] != str(index):
            raise RuntimeError("The chat template reordered the messages; cannot build the prompt safely.")
        text = _content_text(message)
        if text:
            content_ids = text_ids(tokenizer, text, special_ids)
            ids.extend(content_ids)
            turn_tokens[slot] += len(content_ids)
    add_template(pieces[-1], n_turn_slots - 1)
    if pending_images:
        raise RuntimeError("The chat template has fewer image slots than the messages have images.")
    return _Encoded(ids, image_paths, counts, turn_tokens)


def _vision_inputs(processor: Any, encoded: _Encoded, kwargs: dict) -> dict:
    images = [_open_image(path) for path in encoded.image_paths]
    out = processor.image_processor(images=images, return_tensors="pt", **kwargs)
    grid = out["image_grid_thw"].to(torch.int64)
    merge = int(processor.image_processor.merge_size) ** 2
    got = [int(n) for n in (grid.prod(dim=-1) // merge).tolist()]
    if got != encoded.image_token_counts:
        raise RuntimeError(f"Visual token counts disagree: size-based {encoded.image_token_counts}, "
                           f"processor {got}")
    return {"pixel_values": out["pixel_values"].to(torch.float32), "image_grid_thw": grid}


def build_prompt(loaded_or_processor: Any, messages: Sequence[ChatMessage], *, enable_thinking: bool,
                 image_token_budget: int, context_length: int, max_new_tokens: int,
                 tools: Sequence[ToolSpec] = (), control_tokens: Sequence[str] = ()) -> PreparedPrompt:
    """Build the prefill inputs of one chat request (see the module docstring for the rules).

    Args:
        loaded_or_processor: a ``LoadedModel`` or a ``Qwen3VLProcessor``-like object (``tokenizer``,
            ``image_processor``, ``chat_template``).
        messages: optional system message first, then user/assistant turns, ending with a user message;
            ``images`` are paths of normalised RGB image files; ``reasoning`` is ignored.
        enable_thinking: passed to the chat template (True: the reply starts inside ``<think>``).
        image_token_budget: visual tokens per image at most (1 token = 32x32 px).
        context_length: tokens the model may hold (prompt + reply).
        max_new_tokens: requested reply length in tokens; may be clamped by the context policy.
        tools: functions the template lists in the system turn (``toolcalls.template_tools``); assistant
            messages' ``tool_calls`` and ``tool`` messages are rendered by the template too.  Tool definitions
            and calls are template text, not message text: ``control_tokens`` (the tokenizer's special-token
            strings) must not occur in them.

    Returns:
        ``PreparedPrompt`` with ``input_ids`` int64 [L]; with images also ``pixel_values`` float32
        [num_patches, 3 * 2 * 16 * 16], ``image_grid_thw`` int64 [num_images, 3] and ``mm_token_type_ids``
        int64 [L] (1 at image-pad positions); ``max_new_tokens`` and ``notice`` from the context policy.

    Raises:
        InvalidInput: empty last message, misplaced system prompt, last message neither from the user nor a
            tool result, a control token in a tool definition or call.
        InvalidImage: an image file cannot be read or has an unusable shape.
        ContextTooLong: the system prompt and the latest turn alone leave no room for 64 new tokens
            (or ``max_new_tokens`` when it is smaller).
    """
    _validate(messages)
    template_tool_list = template_tools(tools) or None
    check_no_control_text(
        [(f"tools[{i}].function", json.dumps(t, ensure_ascii=False)) for i, t in enumerate(template_tool_list or [])]
        + [(f"messages[{i}].tool_calls", f"{c.name} {c.arguments}") for i, m in enumerate(messages)
           for c in m.tool_calls], control_tokens)
    processor = _processor_of(loaded_or_processor)
    image_processor = processor.image_processor
    kwargs = _image_kwargs(image_processor, image_token_budget)
    system, turns = _split_turns(messages)
    offset = 1 if system else 0

    image_tokens = {path: _visual_tokens(image_processor, path, kwargs)
                    for message in messages for path in message.images}
    encoded = _encode(processor, system, turns, enable_thinking, image_tokens, template_tool_list)

    dropped = 0
    dropped_tokens = 0
    if len(encoded.ids) + max_new_tokens > context_length:
        # Oldest turns first; the last turn (latest user message) always stays.
        excess = len(encoded.ids) + max_new_tokens - context_length
        costs = encoded.turn_tokens[offset:offset + len(turns) - 1]
        while dropped < len(costs) and dropped_tokens < excess:
            dropped_tokens += costs[dropped]
            dropped += 1
        while dropped:
            encoded = _encode(processor, system, turns[dropped:], enable_thinking, image_tokens, template_tool_list)
            # Re-check on the real ids (a template may add or remove a few tokens with the turns).
            if len(encoded.ids) + max_new_tokens <= context_length or dropped == len(turns) - 1:
                break
            dropped += 1
        dropped_tokens = sum(costs[:dropped])  # tokens of the dropped turns, for the notice

    prompt_tokens = len(encoded.ids)
    notices = []
    if dropped:
        notices.append(f"The {dropped} oldest turn{'s' if dropped > 1 else ''} of this conversation "
                       f"({dropped_tokens} tokens) did not fit the model's context of {context_length} "
                       f"tokens and {'were' if dropped > 1 else 'was'} left out of the prompt.")
    new_tokens = max_new_tokens
    if prompt_tokens + new_tokens > context_length:
        room = context_length - prompt_tokens
        least = min(MIN_NEW_TOKENS, max_new_tokens)
        if room < least:
            raise ContextTooLong.for_prompt(prompt_tokens, context_length, least, after_dropping=bool(dropped))
        new_tokens = room
        notices.append(f"The reply is limited to {new_tokens} new tokens (instead of {max_new_tokens}) to fit "
                       f"the context of {context_length} tokens.")

    input_ids = torch.tensor(encoded.ids, dtype=torch.int64)
    prepared = PreparedPrompt(input_ids=input_ids, max_new_tokens=new_tokens, notice=" ".join(notices),
                              dropped_messages=sum(len(turn.messages) for turn in turns[:dropped]),
                              shared_prefix=shared_prefix(processor.tokenizer, encoded.ids),
                              system_prefix=system_prefix(processor.tokenizer, encoded.ids))
    if encoded.image_paths:
        vision = _vision_inputs(processor, encoded, kwargs)
        image_pad_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        prepared.pixel_values = vision["pixel_values"]
        prepared.image_grid_thw = vision["image_grid_thw"]
        prepared.mm_token_type_ids = (input_ids == image_pad_id).to(torch.int64)
    return prepared


def photo_prompt(loaded_or_processor: Any, *, side: int, image_token_budget: int, context_length: int,
                 system: Optional[str] = None, control_tokens: Sequence[str] = ()) -> PreparedPrompt:
    """The prompt a request with one photo builds (optional ``system`` message, then the photo and a question,
    thinking off, one new token): the photo is ``side`` x ``side`` px of seeded noise, the same on every call.
    For warm-ups, which run each code path a request meets before the first request does.  Raises as
    ``build_prompt``."""
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (side, side, 3), generator=gen, dtype=torch.uint8).numpy()
    messages = [ChatMessage(role="system", text=system)] if system else []
    with tempfile.TemporaryDirectory(prefix="qwen-chat-photo-") as folder:
        path = Path(folder) / "photo.png"
        Image.fromarray(pixels, "RGB").save(path)
        messages.append(ChatMessage(role="user", text="What is in this photo?", images=(str(path),)))
        return build_prompt(loaded_or_processor, messages, enable_thinking=False,
                            image_token_budget=image_token_budget, context_length=context_length, max_new_tokens=1,
                            control_tokens=control_tokens)
