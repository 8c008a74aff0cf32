"""Plain-Python types shared by the engine and the web layer (no torch, no Gradio here).

The web layer (``qwen_chat.web``) and the OpenAI-compatible API only ever see these types and the
``ChatBackend`` protocol; the engine (``qwen_chat.engine``) implements the protocol.  Keeping them free of
torch lets the whole UI be tested against a scripted backend.

Sampling ranges and presets come from the Qwen3.5 model card (``docs/facts.md``, "Recommended sampling
(model card)").  ``is_blank`` is the one rule for an empty message, used by the UI, the API and the engine.
"""
from __future__ import annotations

import threading
import unicodedata
from dataclasses import dataclass, field, replace
from typing import Iterator, Literal, Optional, Protocol, Sequence

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "cancelled", "error", "tool_calls"]
ToolChoice = Literal["auto", "none", "required"]

# (low, high) inclusive ranges that the UI sliders show and every entry point enforces.
MAX_NEW_TOKENS_RANGE = (64, 8192)  # the UI slider; the engine and the API accept MAX_NEW_TOKENS_ACCEPTED
TEMPERATURE_RANGE = (0.0, 1.5)
TOP_P_RANGE = (0.1, 1.0)
TOP_K_RANGE = (1, 100)
PRESENCE_PENALTY_RANGE = (0.0, 2.0)
SEED_RANGE = (0, 2**63 - 1)
# Ranges without a UI slider (API fields); OpenAI's ranges where OpenAI defines one.
MAX_NEW_TOKENS_ACCEPTED = (1, MAX_NEW_TOKENS_RANGE[1])  # OpenAI accepts any max_tokens >= 1
FREQUENCY_PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range
CHOICES_RANGE = (1, 8)  # n: replies sampled from one prefill
TOP_LOGPROBS_RANGE = (0, 20)  # OpenAI's range
THINKING_TOKEN_BUDGET_RANGE = (0, MAX_NEW_TOKENS_RANGE[1])


def is_blank(text: Optional[str]) -> bool:
    """True when ``text`` is None or holds only whitespace and invisible format characters.

    Whitespace is what ``str.isspace`` accepts (spaces, tabs, newlines, NBSP U+00A0, the Unicode spaces);
    invisible format characters are Unicode category Cf: zero-width space and joiners (U+200B-U+200D), word
    joiner (U+2060), BOM (U+FEFF), soft hyphen (U+00AD), bidi marks (U+200E, U+200F), Mongolian vowel
    separator (U+180E) and the like.  A message that is blank and has no image is refused (the UI sends
    nothing, the API answers 400, the engine raises ``InvalidInput``).
    """
    return not text or all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in text)


class ChatError(Exception):
    """Base class of every error whose message is meant for the user (shown in the UI, API 4xx/5xx).

    ``kind`` is a short stable label used for metrics and for the API error ``type``.
    """

    kind = "chat_error"
    http_status = 400


class InvalidInput(ChatError):
    """The request is malformed: empty message, bad parameter, unsupported or broken image.

    ``param``: the offending request field when known (API JSON path, e.g. ``response_format``), else None.
    """

    kind = "invalid_input"

    def __init__(self, message: str = "", param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class InvalidImage(InvalidInput):
    """An uploaded file is not an acceptable image (not an image, truncated, too big, too small)."""

    kind = "invalid_image"


class ContextTooLong(InvalidInput):
    """The prompt cannot fit into the model's context even after the context policy was applied.

    Attributes: ``prompt_tokens`` (int) and ``context_length`` (int), both in tokens.
    """

    kind = "context_too_long"

    def __init__(self, message: str, prompt_tokens: int, context_length: int):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length

    @classmethod
    def for_prompt(cls, prompt_tokens: int, context_length: int, reply_tokens: int = 1,
                   after_dropping: bool = False) -> "ContextTooLong":
        """The one message of a prompt that does not fit (prompt building, the scheduler and the runner all
        refuse with it): ``prompt_tokens`` plus at least ``reply_tokens`` exceed ``context_length``;
        ``after_dropping``: the context policy already left out every earlier turn.  The last sentence is the
        page's advice (the API swaps it for its own: ``web.api.protocol.context_message``)."""
        return cls(
            f"The message is too long for the model's context: the prompt needs {prompt_tokens} tokens"
            f"{' even after leaving out all earlier turns' if after_dropping else ''}, plus at least "
            f"{reply_tokens} for the reply, but the context holds {context_length} tokens. "
            "Shorten the message or system prompt, attach fewer or smaller images, or start a new chat.",
            prompt_tokens=prompt_tokens, context_length=context_length)


class Busy(ChatError):
    """The generation queue is full; the caller should retry later (HTTP 429)."""

    kind = "busy"
    http_status = 429


class NotReady(ChatError):
    """The engine is still loading or has failed its self-check (HTTP 503)."""

    kind = "not_ready"
    http_status = 503


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call (OpenAI ``tools[i].function``): ``name``, ``description`` and
    ``parameters``, the JSON schema of its arguments object (``{}``: none declared)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCall:
    """One function call (OpenAI ``tool_calls[i]``): ``id`` (``call_...``), the function ``name`` and its
    ``arguments``, a JSON object as text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling and prompt settings of one request.

    Units: ``max_new_tokens`` in tokens; ``temperature`` 0 means greedy (argmax); ``top_p`` is the nucleus mass
    in (0, 1]; ``top_k`` the number of candidates kept; ``presence_penalty`` is subtracted once from the logit
    of every token already generated in this reply (OpenAI/vLLM definition); ``seed`` makes sampling
    reproducible (None: fresh random seed per request).  ``stop`` are extra stop strings (API only).

    API fields (the UI leaves their defaults): ``frequency_penalty`` is subtracted ``count`` times from the
    logit of a token generated ``count`` times in this reply (OpenAI's definition; like ``presence_penalty``
    not applied at temperature 0); ``n`` replies are sampled from one prefill (choice i uses ``seed + i``);
    ``top_logprobs``: None = no log-probabilities, k = each answer token's log-probability and its k most
    likely alternatives; ``thinking_token_budget``: with thinking on, after that many reasoning tokens the
    engine emits ``</think>`` and the answer follows (None: no budget).

    Tools and structured output (API only; ``qwen_chat.engine.core.constraints``): ``tools`` are rendered
    by the chat template and the model's calls parsed from the answer; ``tool_choice`` "auto" (the model
    decides), "none" (no tools shown), "required" (constrained decoding: the answer is one or more calls);
    ``forced_tool``: the one function that must be called (implies "required"); ``parallel_tool_calls``
    False keeps one call at most; ``json_schema``: the answer must be JSON matching it (after the reasoning).
    """

    max_new_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 20
    presence_penalty: float = 1.5
    seed: Optional[int] = None
    enable_thinking: bool = True
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    n: int = 1
    top_logprobs: Optional[int] = None
    thinking_token_budget: Optional[int] = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = "auto"
    forced_tool: Optional[str] = None
    parallel_tool_calls: bool = True
    json_schema: Optional[dict] = None

    @classmethod
    def preset(cls, enable_thinking: bool, **overrides) -> "GenerationSettings":
        """Qwen3.5 model-card defaults for the mode (thinking general / non-thinking general)."""
        if enable_thinking:
            base = cls(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, enable_thinking=True)
        else:
            base = cls(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, enable_thinking=False)
        return replace(base, **overrides)

    def validate(self) -> "GenerationSettings":
        """Return self if every value is inside its documented range.

        Raises:
            InvalidInput: naming the parameter, the value and the allowed range (never clamps silently).
        """
        checks = [
            ("max_new_tokens", self.max_new_tokens, MAX_NEW_TOKENS_ACCEPTED, int),
            ("temperature", self.temperature, TEMPERATURE_RANGE, float),
            ("top_p", self.top_p, TOP_P_RANGE, float),
            ("top_k", self.top_k, TOP_K_RANGE, int),
            ("presence_penalty", self.presence_penalty, PRESENCE_PENALTY_RANGE, float),
            ("frequency_penalty", self.frequency_penalty, FREQUENCY_PENALTY_RANGE, float),
            ("n", self.n, CHOICES_RANGE, int),
        ]
        if self.top_logprobs is not None:
            checks.append(("top_logprobs", self.top_logprobs, TOP_LOGPROBS_RANGE, int))
        if self.thinking_token_budget is not None:
            checks.append(("thinking_token_budget", self.thinking_token_budget, THINKING_TOKEN_BUDGET_RANGE, int))
        for name, value, (low, high), kind in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidInput(f"{name} must be a number in [{low}, {high}], got {value!r}")
            if value != value or not (low <= value <= high):  # value != value catches NaN; also infinities
                raise InvalidInput(f"{name} must be in [{low}, {high}], got {value!r}")
            if kind is int and int(value) != value:
                raise InvalidInput(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
                SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
            ):
                raise InvalidInput(f"seed must be an integer in [0, 2**63-1], got {self.seed!r}")
        if len(self.stop) > 4 or any((not isinstance(s, str)) or not s for s in self.stop):
            raise InvalidInput("stop must be at most 4 non-empty strings")
        self._validate_tools()
        return self

    def _validate_tools(self) -> None:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidInput("tools: two tools have the same name", param="tools")
        if self.tool_choice not in ("auto", "none", "required"):
            raise InvalidInput(f"tool_choice must be auto, none or required, got {self.tool_choice!r}",
                               param="tool_choice")
        if self.forced_tool is not None and self.forced_tool not in names:
            raise InvalidInput(f"tool_choice: no tool is named {self.forced_tool!r}", param="tool_choice")
        if (self.tool_choice == "required" or self.forced_tool is not None) and not self.tools:
            raise InvalidInput("tool_choice requires a tool call but no tools were given", param="tool_choice")
        if self.json_schema is not None and (self.tool_choice == "required" or self.forced_tool is not None):
            raise InvalidInput("response_format cannot be combined with a required tool call (the reply is "
                               "the call)", param="response_format")


@dataclass(frozen=True)
class ChatMessage:
    """One stored turn.  ``images`` are paths of already-normalised image files (RGB, EXIF applied).

    ``reasoning`` is the assistant's thinking text, kept apart from ``text`` and never sent back to the model.
    ``tool_calls``: the calls an assistant message made (a ``tool`` message is a call's result, in ``text``).
    """

    role: Role
    text: str
    images: tuple[str, ...] = ()
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


def conversation_problem(messages: Sequence["ChatMessage"]) -> Optional[tuple[int, str, str]]:
    """What makes ``messages`` a conversation the model cannot answer, as ``(index of the message, its field
    "role" or "content", a message for the user)``, or None when it can be answered.  The one check of a
    conversation's shape: prompt building raises ``InvalidInput`` with it, the API a 400 naming
    ``messages[index].field``.  Rules: at least one message; roles system, user, assistant, tool; a system
    message only first; the last message from the user or a tool result; a last user message not blank
    (``is_blank``) unless it has an image."""
    if not messages:
        return 0, "role", "There is no message to answer."
    for index, message in enumerate(messages):
        if message.role not in ("system", "user", "assistant", "tool"):
            return index, "role", f"Unknown message role {message.role!r} (system, user, assistant, tool)."
        if message.role == "system" and index != 0:
            return index, "role", "A system message can only come first in a conversation."
        if not isinstance(message.text, str):
            return index, "content", "Message text must be a string."
    last = messages[-1]
    if last.role not in ("user", "tool"):
        return len(messages) - 1, "role", "The last message must be from the user (or a tool result)."
    if last.role == "user" and is_blank(last.text) and not last.images:
        return len(messages) - 1, "content", "The message is empty: type some text or attach an image."
    return None


@dataclass(frozen=True)
class StreamUpdate:
    """One step of a streamed reply.

    ``reasoning``/``answer`` are the full texts so far; ``reasoning_delta``/``answer_delta`` what this update
    added (never ending in a split UTF-8 character).  ``thinking`` is True while the model is still inside its
    reasoning.  ``finish_reason`` is set on the last update only.  ``notice`` is a user-facing remark (context
    turns dropped, token limit reached while thinking...).  Token counts in tokens, ``ttft_s`` in seconds.

    ``index``: the choice (0 .. ``settings.n`` - 1) this update belongs to; with n > 1 the updates of the
    choices interleave and each choice has its own last update.  ``reasoning_tokens``: completion tokens
    sampled before ``</think>`` (all of them when the reply ended inside its reasoning).  ``logprobs``: the
    answer tokens this update added, with their log-probabilities (only when ``settings.top_logprobs`` is set).
    ``dropped_messages``: messages the context policy left out of the prompt (oldest turns first).
    ``cached_tokens``: prompt tokens that were not prefilled because the conversation cache held them.
    ``tool_calls``: the calls parsed from the answer so far (all of them, like ``answer``); a reply that ended
    after calls has ``finish_reason`` "tool_calls".
    """

    reasoning: str = ""
    answer: str = ""
    reasoning_delta: str = ""
    answer_delta: str = ""
    thinking: bool = False
    finish_reason: Optional[FinishReason] = None
    notice: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: Optional[float] = None
    index: int = 0
    reasoning_tokens: int = 0
    logprobs: tuple["TokenLogprob", ...] = ()
    dropped_messages: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token and its log-probability (natural log) under the model's distribution at that step.

    ``token``: its text (``bytes`` decoded as UTF-8; a token that is not whole UTF-8 reads ``bytes:\\xNN...``);
    ``bytes``: its raw UTF-8 bytes (ints 0-255); ``top``: the k most likely tokens of that step as
    ``(token, logprob, bytes)``, most likely first (empty when k = 0).
    """

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] = ()


class CancelToken:
    """Thread-safe flag that asks a running generation to stop at the next decode step; ``on_cancel`` wakes a
    waiting consumer instead of it polling the flag."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list = []

    def cancel(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def on_cancel(self, fn) -> None:
        """Call ``fn()`` (must not raise) once, from the thread that cancels (now if already cancelled)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


@dataclass(frozen=True)
class ModelInfo:
    """What the UI and API show about the loaded model."""

    name: str
    demo: bool  # True for the built-in tiny model with random weights
    context_length: int  # tokens
    world_size: int = 1
    mode: str = "single"  # "single", "tp", "zero3", "zero3-offload"


class ChatBackend(Protocol):
    """What the web layer and the API need from the engine.  Implemented by ``qwen_chat.engine.core.chat_engine``."""

    info: ModelInfo

    def stream_chat(
        self,
        messages: Sequence[ChatMessage],
        settings: GenerationSettings,
        cancel: CancelToken,
    ) -> Iterator[StreamUpdate]:
        """Validate, build the prompt, queue, and stream the reply.

        Raises before the first update (never mid-stream) ``InvalidInput``/``InvalidImage``/``ContextTooLong``
        for bad requests, ``Busy`` when the queue is full and ``NotReady`` while loading.  Closing the
        generator or cancelling ``cancel`` stops the generation within one decode step; the last update then
        has ``finish_reason == "cancelled"``.
        """
        ...

    def health(self) -> dict:
        """{"ok": bool, "reason": str, ...} for /healthz (all ranks alive, self-check passed)."""
        ...
