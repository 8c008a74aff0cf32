"""Tests for the streaming reply decoder (UTF-8-safe deltas, reasoning split, stop strings).

Two known failures of chat services: thinking mode (the template pre-fills ``<think>``, so the model never
writes it; a reply cut off while thinking) and streaming text (characters split across tokens shown as U+FFFD,
a stream stalled after a literal U+FFFD, RTL text with ZWJ sequences).  Uses the real Qwen3.5 tokenizer built
offline (about 5-8 s once per module).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from qwen_chat.engine.text.textstream import (
    IM_END_ID,
    THINK_END_ID,
    THINK_START_ID,
    ReplyDecoder,
    StopStringFilter,
    find_stop_string,
    stop_prefix_length,
)
from qwen_chat.engine.text.tokenizer_build import build_qwen35_tokenizer

IM_START_ID = 248045
IMAGE_PAD_ID = 248056
ENDOFTEXT_ID = 248044


@pytest.fixture(scope="module")
def tok():
    return build_qwen35_tokenizer()


def encode(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert all(i < 248044 for i in ids), "sample text must encode to regular BPE ids only"
    return ids


def stream(decoder: ReplyDecoder, ids) -> list[tuple[str, str]]:
    """Push ids one at a time, then finish; return every (reasoning_delta, answer_delta)."""
    chunks = [decoder.push([i]) for i in ids]
    chunks.append(decoder.finish())
    return chunks


def answers(chunks) -> list[str]:
    return [a for _, a in chunks]


# --- UTF-8 safety ------------------------------------------------------------------------------------

def test_cjk_emoji_and_split_letter_stream_whole(tok):
    text = "笑脸 😊 and the name c.ⱯI"
    ids = encode(tok, text)
    # The sample really splits characters across tokens: decoding token by token would show U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    chunks = answers(stream(decoder, ids))
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == text
    assert decoder.answer == text
    assert decoder.reasoning == ""
    # Tokens that end inside a character produce an empty delta (held back), the next one completes it.
    held = [i for i, c in enumerate(chunks[:-1]) if c == ""]
    assert held and all("\ufffd" in tok.decode([ids[i]]) for i in held)


def test_any_chunking_gives_identical_text(tok):
    text = "数学の証明 🚀🧑‍🚀 ñandú Ɐ 한국어 text"
    ids = encode(tok, text)
    rng = random.Random(7)
    for _ in range(20):
        decoder = ReplyDecoder(tok, starts_in_reasoning=False)
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            out.append(decoder.push(ids[i:i + n])[1])
            i += n
        out.append(decoder.finish()[1])
        assert "".join(out) == text
        assert not any("\ufffd" in c for c in out)


def test_literal_replacement_char_streams_without_stall(tok):
    text = "prefix \ufffd after"
    ids = encode(tok, text)
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    for i in ids:
        decoder.push([i])
    # Everything, including "after", is visible before finish() is called.
    assert decoder.answer == text
    assert decoder.answer.count("\ufffd") == 1
    decoder.finish()
    assert decoder.answer == text


def test_rtl_and_zwj_sequences(tok):
    text = "مرحبا بالعالم שלום עולם 👨\u200d👩\u200d👧 ab\u200dcd"
    ids = encode(tok, text)
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    chunks = answers(stream(decoder, ids))
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == text
    assert "👨\u200d👩\u200d👧" in decoder.answer
    assert "ab\u200dcd" in decoder.answer


def test_reply_cut_mid_character_drops_the_fragment(tok):
    ids = encode(tok, "ok 😊")
    # Find a prefix of the ids that ends inside the emoji's bytes.
    cut = next(n for n in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:n]))
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    chunks = answers(stream(decoder, ids[:cut]))
    assert "".join(chunks) == "ok "  # the leading word only; no U+FFFD at the end
    assert decoder.answer == "ok "


def test_really_invalid_bytes_show_replacement_char(tok):
    # A lone continuation byte 0x80 followed by "a": invalid UTF-8 the model produced itself.
    byte_80 = tok.convert_tokens_to_ids("Ģ")  # GPT-2 byte table: 0x80 -> U+0122 'Ģ'
    assert tok.decode([byte_80]) == "\ufffd"
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    decoder.push(encode(tok, "x"))
    delta = decoder.push([byte_80] + encode(tok, "a"))[1]
    assert delta == "\ufffda"


# --- reasoning split ---------------------------------------------------------------------------------

def test_reasoning_then_answer_at_think_end(tok):
    ids = encode(tok, "The user asks 1+1. That is 2.\n") + [THINK_END_ID] + encode(tok, "\n\n2") + [IM_END_ID]
    decoder = ReplyDecoder(tok, starts_in_reasoning=True)
    assert decoder.in_reasoning
    chunks = stream(decoder, ids)
    assert decoder.reasoning == "The user asks 1+1. That is 2."
    assert decoder.answer == "2"
    assert not decoder.in_reasoning
    assert "".join(r for r, _ in chunks) == decoder.reasoning
    assert "".join(a for _, a in chunks) == "2"
    assert "think>" not in decoder.reasoning + decoder.answer


def test_answer_deltas_only_after_think_end(tok):
    reasoning_ids = encode(tok, "step one, step two")
    decoder = ReplyDecoder(tok, starts_in_reasoning=True)
    for i in reasoning_ids:
        assert decoder.push([i])[1] == ""
    r, a = decoder.push([THINK_END_ID] + encode(tok, "\n\nDone."))
    assert a == "Done."
    assert decoder.reasoning == "step one, step two"


def test_cut_off_while_thinking_is_all_reasoning(tok):
    ids = encode(tok, "Proof. Suppose there are finitely many primes p1..pn. Consider")
    decoder = ReplyDecoder(tok, starts_in_reasoning=True)
    stream(decoder, ids)
    assert decoder.reasoning == "Proof. Suppose there are finitely many primes p1..pn. Consider"
    assert decoder.answer == ""
    assert decoder.in_reasoning


def test_stray_think_start_is_dropped(tok):
    ids = [THINK_START_ID] + encode(tok, "\nhmm\n") + [THINK_END_ID] + encode(tok, "\n\nHello")
    decoder = ReplyDecoder(tok, starts_in_reasoning=True)
    stream(decoder, ids)
    assert decoder.reasoning == "hmm"
    assert decoder.answer == "Hello"


def test_reasoning_whitespace_inside_is_kept_and_trailing_held_back(tok):
    decoder = ReplyDecoder(tok, starts_in_reasoning=True)
    r1, _ = decoder.push(encode(tok, "line one\n"))
    assert r1 == "line one"  # trailing newline held back
    r2, _ = decoder.push(encode(tok, "\nline two"))
    assert r2 == "\n\nline two"
    decoder.push(encode(tok, "  \n") + [THINK_END_ID])
    assert decoder.reasoning == "line one\n\nline two"


def test_thinking_off_everything_is_answer(tok):
    ids = encode(tok, "Plain answer with 😊") + [IM_END_ID]
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    chunks = stream(decoder, ids)
    assert decoder.answer == "Plain answer with 😊"
    assert decoder.reasoning == ""
    assert not decoder.in_reasoning
    assert all(r == "" for r, _ in chunks)


def test_control_ids_never_become_text(tok):
    ids = (encode(tok, "a") + [IM_START_ID, IMAGE_PAD_ID, ENDOFTEXT_ID, THINK_START_ID, THINK_END_ID]
           + encode(tok, "b") + [IM_END_ID])
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    stream(decoder, ids)
    assert decoder.answer == "ab"


def test_padding_ids_beyond_the_vocabulary_make_no_text(tok):
    # The model's logits have 248,320 rows, the tokenizer 248,077 tokens; a random-weight model samples
    # the padding ids too.
    ids = encode(tok, "a") + [248100, 248319] + encode(tok, "b")
    decoder = ReplyDecoder(tok, starts_in_reasoning=False)
    stream(decoder, ids)
    assert decoder.answer == "ab" == tok.decode(ids)


def test_accepts_processor_and_rejects_push_after_finish(tok):
    processor = SimpleNamespace(tokenizer=tok)
    decoder = ReplyDecoder(processor, starts_in_reasoning=False)
    assert decoder.push(encode(tok, "hi")) == ("", "hi")
    decoder.finish()
    with pytest.raises(RuntimeError):
        decoder.push(encode(tok, "more"))
    with pytest.raises(TypeError):
        ReplyDecoder(object(), starts_in_reasoning=False)


# --- stop strings -------------------------------------------------------------------------------------

def test_find_stop_string_returns_earliest():
    assert find_stop_string("hello END world STOP", ["STOP", "END"]) == 6
    assert find_stop_string("nothing here", ["STOP"]) == -1
    assert find_stop_string("abc", []) == -1
    assert find_stop_string("abc", [""]) == -1


def test_stop_prefix_length():
    assert stop_prefix_length("answer: ST", ["STOP"]) == 2
    assert stop_prefix_length("answer: STO", ["STOP", "Oz"]) == 3
    assert stop_prefix_length("answer", ["STOP"]) == 0
    assert stop_prefix_length("xS", ["S"]) == 0  # a 1-char stop has no proper prefix


def test_stop_filter_across_deltas():
    f = StopStringFilter(["</end>"])
    out = [f.push("Hello </"), f.push("en"), f.push("d> ignored"), f.push("more")]
    assert out == ["Hello ", "", "", ""]
    assert f.stopped
    assert f.text == "Hello "
    assert f.finish() == ""


def test_stop_filter_releases_false_alarm():
    f = StopStringFilter(["STOP"])
    assert f.push("go ST") == "go "
    assert f.push("AY here") == "STAY here"
    assert f.push(" ST") == " "
    assert f.finish() == "ST"
    assert f.text == "go STAY here ST"
    assert not f.stopped
