"""The update stream of one request: the sampled ids of its n choices turned into ``StreamUpdate``s.

``stream_replies`` reads the choices' handles together (``handles.group_chunks``) and keeps, per choice, a
``ReplyDecoder`` (UTF-8-safe deltas, reasoning split at ``</think>``), the API's stop strings
(``StopStringFilter``), the count of reasoning tokens, when asked, the log-probabilities of the answer's
tokens, and with tools a ``ToolCallSplitter`` that takes the model's calls out of the answer (a
``<tool_call>`` inside the reasoning ends the reasoning: the template puts calls after it; a reply that made
calls ends with finish_reason "tool_calls").  Each choice ends with its own last update (``finish_reason`` set); the stream ends after the last
choice has ended.  With n = 1 this is the reply stream ``ChatEngine.stream_chat`` always had.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from qwen_chat.chat_types import GenerationSettings, StreamUpdate, TokenLogprob
from qwen_chat.engine.core.handles import RequestHandle, group_chunks

if TYPE_CHECKING:
    from qwen_chat.engine.types import PreparedPrompt
from qwen_chat.engine.text.textstream import ReplyDecoder, StopStringFilter
from qwen_chat.engine.text.toolcalls import ToolCallSplitter

log = logging.getLogger(__name__)

#: Notice on a reply that hit the token limit before ``</think>`` (a reply cut off while thinking: all of it
#: is reasoning, the answer is empty).
THINKING_CUT_NOTICE = "stopped: token limit reached while thinking"


class _Choice:
    """The text state of one choice: its index, counters, decoder, stop filter, reasoning-token count, finish."""

    def __init__(self, index: int, tokenizer, settings: GenerationSettings,
                 think_ids: tuple[int, int], eos_ids: Sequence[int],
                 tool_ids: Optional[tuple[int, int]] = None) -> None:
        self.index = index
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft_s: Optional[float] = None
        self.stopped_by_string = False
        self.think_end = think_ids[1]
        tools = settings.tools if settings.tool_choice != "none" and tool_ids is not None else ()
        self.decoder = ReplyDecoder(tokenizer, starts_in_reasoning=settings.enable_thinking,
                                    think_start_id=think_ids[0], think_end_id=think_ids[1], stop_ids=eos_ids,
                                    literal_ids=tool_ids if tools else ())
        self.calls = ToolCallSplitter(tools, lambda t: self.decoder.token_piece(t)[1],
                                      parallel=settings.parallel_tool_calls, open_id=tool_ids[0],
                                      close_id=tool_ids[1]) if tools else None
        self.stops = StopStringFilter(settings.stop) if settings.stop else None
        self.reasoning_tokens = 0
        self.finish: Optional[str] = None  # set once its last update was made
        self._pieces: dict[int, tuple[str, tuple[int, ...]]] = {}

    def push(self, ids: list[int], logprobs: list) -> tuple[str, str, list[TokenLogprob]]:
        """Decode newly sampled ids: ``(reasoning_delta, answer_delta, log-probabilities of the answer's ids)``.
        Stops at a completed stop string (``self.stops.stopped``); the ids after it are dropped."""
        r_out, a_out, entries = [], [], []
        for token, logprob in zip(ids, logprobs):
            in_reasoning = self.decoder.in_reasoning
            if in_reasoning and self.calls is not None and token == self.calls.open_id:
                r_out.append(self.decoder.push([self.think_end])[0])  # a call ends the reasoning
                in_reasoning = False
            if in_reasoning and token != self.think_end:
                self.reasoning_tokens += 1
            text_ids = [token] if self.calls is None or in_reasoning else self.calls.feed(token)
            r_delta, a_delta = self.decoder.push(text_ids)
            if self.stops is not None:
                a_delta = self.stops.push(a_delta)
            r_out.append(r_delta)
            a_out.append(a_delta)
            if logprob is not None and not in_reasoning:
                entries.append(self._entry(token, logprob))
            if self.stops is not None and self.stops.stopped:
                break
        return "".join(r_out), "".join(a_out), entries

    def tails(self) -> tuple[str, str]:
        """The decoder's and the stop filter's last text at the end of the choice (a call left open is text)."""
        r_open, a_open = self.decoder.push(self.calls.flush()) if self.calls is not None else ("", "")
        r_tail, a_tail = self.decoder.finish()
        r_tail, a_tail = r_open + r_tail, a_open + a_tail
        if self.stops is not None:
            a_tail = self.stops.push(a_tail) + self.stops.finish()
        return r_tail, a_tail

    def answer(self) -> str:
        return self.stops.text if self.stops else self.decoder.answer

    def tool_calls(self) -> tuple:
        return tuple(self.calls.calls) if self.calls is not None else ()

    def _piece(self, token: int) -> tuple[str, tuple[int, ...]]:
        piece = self._pieces.get(token)
        if piece is None:
            text, data = self.decoder.token_piece(token)
            piece = self._pieces[token] = (text, tuple(data))
        return piece

    def _entry(self, token: int, logprob) -> TokenLogprob:
        text, data = self._piece(token)
        top = []
        for alt, lp in zip(logprob.top_ids, logprob.top_logprobs):
            alt_text, alt_data = self._piece(alt)
            top.append((alt_text, lp, alt_data))
        return TokenLogprob(token=text, logprob=logprob.logprob, bytes=data, top=tuple(top))


class ReplyAssembler:
    """Push-based output processing of one request's n choices: ``feed`` takes what one engine step produced
    for a choice (token ids, their log-probabilities, whether it finished) and returns the ``StreamUpdate``s
    it makes.  Used once per step for every request (the front's output thread) and, over ``group_chunks``, by
    ``stream_replies`` (one process).

    Args:
        n: choices (indexes 0 .. n-1).  settings: the request's ``GenerationSettings``.
        prompt_tokens / notice / dropped_messages: the prompt's token count, the context policy's remark and how
            many messages it left out (``PreparedPrompt``).
        tokenizer, think_ids, eos_ids, tool_ids: as for ``stream_replies``.
    """

    def __init__(self, n: int, settings: GenerationSettings, *, prompt_tokens: int, notice: str,
                 dropped_messages: int, tokenizer, think_ids: tuple[int, int], eos_ids: Sequence[int],
                 tool_ids: Optional[tuple[int, int]] = None, request_id: int = 0) -> None:
        self.choices = [_Choice(index, tokenizer, settings, think_ids, eos_ids, tool_ids) for index in range(n)]
        self.prompt_tokens, self.notice, self.dropped = int(prompt_tokens), notice, int(dropped_messages)
        self.request_id = request_id
        self.open = n

    @property
    def done(self) -> bool:
        """True once every choice has had its last update."""
        return self.open == 0

    def _update(self, c: "_Choice", r_delta: str, a_delta: str, entries=(), **final) -> StreamUpdate:
        return StreamUpdate(
            reasoning=c.decoder.reasoning, answer=c.answer(), reasoning_delta=r_delta, answer_delta=a_delta,
            thinking=c.decoder.in_reasoning, prompt_tokens=self.prompt_tokens,
            completion_tokens=c.completion_tokens, ttft_s=c.ttft_s, index=c.index,
            reasoning_tokens=c.reasoning_tokens, logprobs=tuple(entries),
            dropped_messages=self.dropped, tool_calls=c.tool_calls(), cached_tokens=c.cached_tokens,
            **{"notice": self.notice, **final},
        )

    def _last(self, c: "_Choice", finish: str, error: str = "") -> StreamUpdate:
        c.finish = finish
        self.open -= 1
        r_tail, a_tail = c.tails()
        notes = [self.notice] if self.notice else []
        if finish == "length" and c.decoder.in_reasoning:
            notes.append(THINKING_CUT_NOTICE)
        elif finish == "error":
            notes.append(f"generation failed: {error or 'engine error'}")
        log.debug(  # the scheduler logs TTFT and tokens/s of every request at INFO
            "reply %d: %s, prompt %d tok, completion %d tok, TTFT %s s", self.request_id, finish,
            self.prompt_tokens, c.completion_tokens, f"{c.ttft_s:.3f}" if c.ttft_s is not None else "-",
        )
        reason = "tool_calls" if finish == "stop" and c.tool_calls() else finish
        return self._update(c, r_tail, a_tail, finish_reason=reason, notice="; ".join(notes))

    def feed(self, index: int, ids: Sequence[int], logprobs: Sequence, *, finish: Optional[str] = None,
             error: str = "", completion_tokens: Optional[int] = None, ttft_s: Optional[float] = None,
             cached_tokens: Optional[int] = None) -> list[StreamUpdate]:
        """What choice ``index`` produced in one step: ``ids`` (token ids, no stop token), ``logprobs`` (one
        ``SampledLogprob``-like entry or None per id), ``finish`` (its finish reason when it ended after them;
        ``error``: the user-facing message of an 'error' finish) and the counters the engine keeps
        (``completion_tokens`` including a final stop token; ``ttft_s`` seconds; ``cached_tokens``).  Returns
        the updates to send, in order (none when nothing visible changed).  A choice ended by one of its stop
        strings has ``stopped_by_string`` set: the caller closes its sequence in the engine."""
        c = self.choices[index]
        if completion_tokens is not None:
            c.completion_tokens = int(completion_tokens)
        else:
            c.completion_tokens += len(ids)
        if ttft_s is not None:
            c.ttft_s = ttft_s
        if cached_tokens is not None:
            c.cached_tokens = int(cached_tokens)
        if c.finish is not None:  # ended by a stop string; the engine's own finish comes later
            return []
        out = []
        if ids:
            was_thinking, calls = c.decoder.in_reasoning, len(c.tool_calls())
            r_delta, a_delta, entries = c.push(list(ids), list(logprobs) or [None] * len(ids))
            if (r_delta or a_delta or entries or c.decoder.in_reasoning != was_thinking
                    or len(c.tool_calls()) != calls):
                out.append(self._update(c, r_delta, a_delta, entries))
            if c.stops is not None and c.stops.stopped:
                c.stopped_by_string = True
                out.append(self._last(c, "stop"))
                return out
        if finish is not None:
            out.append(self._last(c, finish, error))
        return out

    def end_open(self, reason: str = "error", error: str = "") -> list[StreamUpdate]:
        """The last updates of the choices still open (the engine went away, or its queue ended early)."""
        return [self._last(c, reason, error) for c in self.choices if c.finish is None]


def stream_replies(handles: Sequence[RequestHandle], prompt: PreparedPrompt, settings: GenerationSettings, *,
                   tokenizer, think_ids: tuple[int, int], eos_ids: Sequence[int],
                   tool_ids: Optional[tuple[int, int]] = None) -> Iterator[StreamUpdate]:
    """The updates of a request's choices (``handles``: index 0..n-1, one shared queue when n > 1), in this
    process: ``group_chunks`` fed to a ``ReplyAssembler``.  ``tool_ids``: ``(<tool_call>, </tool_call>)``;
    with ``settings.tools`` (tool_choice not "none") the calls are parsed out of the answer into
    ``StreamUpdate.tool_calls``.

    An update is yielded when a choice's text grew, its reasoning ended, or it got log-probabilities; each
    choice's last update has its ``finish_reason`` ('stop' also for a stop string, 'length', 'cancelled',
    'error') and ``notice`` (the context policy's remark, token limit while thinking, engine error).  Closing
    the iterator closes every handle (the choices leave the batch at the next step).
    """
    assembler = ReplyAssembler(len(handles), settings, prompt_tokens=prompt.num_tokens, notice=prompt.notice,
                               dropped_messages=prompt.dropped_messages, tokenizer=tokenizer,
                               think_ids=think_ids, eos_ids=eos_ids, tool_ids=tool_ids,
                               request_id=handles[0].request_id)
    by_index = {h.index: h for h in handles}
    try:
        for chunk in group_chunks(handles):
            h = by_index[chunk.index]
            finish = (h.finish_reason or "error") if chunk.finished else None
            for update in assembler.feed(chunk.index, chunk.ids, chunk.logprobs, finish=finish, error=h.error,
                                         completion_tokens=h.completion_tokens, ttft_s=h.ttft_s,
                                         cached_tokens=h.cached_tokens):
                if update.finish_reason is not None and assembler.choices[chunk.index].stopped_by_string:
                    h.close()  # leaves the batch at the next step
                yield update
            if assembler.done:
                return
        for update in assembler.end_open():  # the queue ended without a finish (not expected)
            yield update
    finally:
        for h in handles:
            h.close()
