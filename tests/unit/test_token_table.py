"""The front's token table comes from a prompt worker (the 33 MB tokenizer.json of Qwen3.5 is parsed there, not
under the front's GIL) and holds exactly the strings of the checkpoint's tokenizer.json."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from qwen_chat.engine.output.updates import TokenTable, token_strings
from qwen_chat.engine.text.prompt_worker import PromptPool


@pytest.mark.slow  # reason: one prompt worker process loads the processor (torch + transformers imports)
def test_the_worker_table_equals_the_tokenizer_file_for_every_id(tiny_checkpoint):
    pool = PromptPool(tiny_checkpoint, workers=1, image_token_budget=64)
    try:
        table = TokenTable(pool.token_strings(timeout_s=240))
        assert pool.wait_warm(240) and not pool.failed()  # (the hello keeps such a pool: engine_hub)
    finally:
        pool.close()
    reference = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    top = max(reference.get_vocab(with_added_tokens=True).values())
    assert [table.convert_ids_to_tokens(i) for i in range(top + 1)] == [reference.id_to_token(i)
                                                                         for i in range(top + 1)]
    ids = reference.encode("<|im_start|>user\nHello, wörld! 你好<|im_end|>").ids
    assert "".join(table.convert_ids_to_tokens(i) for i in ids) == "".join(reference.id_to_token(i) for i in ids)
    assert table.convert_ids_to_tokens(top + 1) is None and table.convert_ids_to_tokens(-1) is None


def test_ids_without_a_token_are_none():
    class Sparse:  # a tokenizer whose ids 0, 1 and 3 have tokens, 2 has none
        def get_vocab(self, with_added_tokens):
            return {"a": 0, "b": 1, "<x>": 3}

        def id_to_token(self, i):
            return {0: "a", 1: "b", 3: "<x>"}.get(i)

    strings = token_strings(Sparse())
    assert strings == ["a", "b", None, "<x>"]
    table = TokenTable(strings)
    assert [table.convert_ids_to_tokens(i) for i in range(5)] == ["a", "b", None, "<x>", None]
