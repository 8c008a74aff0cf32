"""The conversation cache's index (``conv_cache``): matching by token ids and image content, the longest kept
prefix, at least one token left to prefill, least-recently-used eviction that skips pinned rows."""
from __future__ import annotations

import torch

from qwen_chat.engine.core.conv_cache import ConversationCache, prompt_key
from qwen_chat.engine.types import PreparedPrompt

IDS = torch.tensor([1, 2, 9, 9, 9, 9, 3, 4, 5, 6])


def image_prompt(pixels: float, mm=True, keep=8) -> PreparedPrompt:
    return PreparedPrompt(input_ids=IDS, pixel_values=torch.full((16, 4), pixels),
                          image_grid_thw=torch.tensor([[1, 4, 4]]),
                          mm_token_type_ids=(IDS == 9).long() if mm else None, shared_prefix=keep)


def test_the_same_ids_around_another_image_do_not_match():
    cache = ConversationCache()
    cache.add(0, prompt_key(image_prompt(1.0)), 8)
    assert cache.match(prompt_key(image_prompt(1.0))).row == 0
    assert cache.match(prompt_key(image_prompt(0.5))) is None
    assert cache.match(prompt_key(image_prompt(0.5, mm=False))) is None   # positions unknown: all pixels compared


def test_the_longest_prefix_that_leaves_a_token_wins_and_eviction_is_lru_but_not_pinned():
    cache = ConversationCache()
    key = prompt_key(PreparedPrompt(input_ids=torch.arange(20), shared_prefix=15))
    assert key.keeps == (15,) and key.system_at == 0
    cache.add(3, key, 5)
    cache.add(4, key, 15)
    cache.add(5, prompt_key(PreparedPrompt(input_ids=torch.arange(30))), 20)   # the whole 20-token prompt
    assert cache.match(key).row == 4                                           # 20 would leave nothing
    other = prompt_key(PreparedPrompt(input_ids=torch.cat([torch.arange(10), torch.full((10,), 7)])))
    assert cache.match(other).row == 3                                         # shares only the first 10
    cache.record(cache.match(key))
    assert (cache.queries, cache.hits, cache.cached_tokens) == (1, 1, 15)
    assert cache.victim(set()) == 5                                            # used least recently
    assert cache.victim({5}) == 3
    cache.remove(5)
    assert sorted(cache.rows()) == [3, 4] and len(cache) == 2


def test_a_long_system_block_is_a_keep_point_a_short_one_is_not():
    """The system block's end becomes a keep point from ``SYSTEM_KEEP_MIN_TOKENS`` tokens on, before the turn's
    own; ``holds_prefix`` finds an entry of exactly those tokens, and a hit on it counts as a system hit."""
    from qwen_chat.engine.core.conv_cache import SYSTEM_KEEP_MIN_TOKENS as M

    ids = torch.arange(M + 40)
    short = prompt_key(PreparedPrompt(input_ids=ids, shared_prefix=M + 30, system_prefix=M - 1))
    assert short.keeps == (M + 30,) and short.system_at == 0
    key = prompt_key(PreparedPrompt(input_ids=ids, shared_prefix=M + 30, system_prefix=M))
    assert key.keeps == (M, M + 30) and key.system_at == M
    cache = ConversationCache()
    assert not cache.holds_prefix(key, M)
    cache.add(1, key, M)
    assert cache.holds_prefix(key, M) and not cache.holds_prefix(key, M - 1)
    other = prompt_key(PreparedPrompt(input_ids=torch.cat([ids[:M], ids[M:] + 1000]), system_prefix=M))
    hit = cache.match(other)
    assert hit.row == 1 and hit.system
    cache.record(hit)
    assert (cache.hits, cache.system_hits, cache.cached_tokens) == (1, 1, M)
    edited = prompt_key(PreparedPrompt(input_ids=torch.cat([ids[:M - 1] + 1, ids[M - 1:]]), system_prefix=M))
    assert cache.match(edited) is None and not cache.holds_prefix(edited, M)
