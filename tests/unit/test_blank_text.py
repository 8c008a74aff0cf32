"""One rule for a blank message: the UI, the API and the engine agree on which characters count as nothing.

Each boundary's own check is called: the UI controller (sends nothing, saves nothing), the API's request
parsing (400 naming the last message's content) and the engine's prompt builder (``InvalidInput``).
"""
from __future__ import annotations

import pytest

from qwen_chat.chat_types import ChatMessage, GenerationSettings, InvalidInput, is_blank
from qwen_chat.config import ServiceConfig
from qwen_chat.history.api_images import ApiImageStore
from qwen_chat.history.store import HistoryStore
from qwen_chat.images import ImageLimits
from qwen_chat.web.api.protocol import APIRequestError, parse_messages
from qwen_chat.web.handlers import ChatController, Session

BLANK = {
    "left-to-right mark U+200E": "\u200e",
    "soft hyphen U+00AD": "\u00ad",
    "zero-width space U+200B": "\u200b",
    "BOM U+FEFF": "\ufeff",
    "no-break space U+00A0": "\u00a0",
    "plain spaces": "   ",
    "all of them with newlines": " \u200e\n\u00ad\t\u200b\ufeff\u00a0 ",
}
NOT_BLANK = {"a letter": "\u200ba\u200e", "a digit": "0", "a soft-hyphenated word": "co\u00adop"}


class RefusingBackend:
    """A backend that must never be asked: a blank message ends at the UI boundary."""

    def stream_chat(self, messages, settings, cancel):
        raise AssertionError("a blank message reached the backend")


@pytest.mark.parametrize("text", BLANK.values(), ids=BLANK.keys())
def test_blank_in_the_rule_the_ui_the_api_and_the_engine(text, tmp_path):
    assert is_blank(text)

    store = HistoryStore(tmp_path / "history")
    controller = ChatController(RefusingBackend(), store)
    views = list(controller.send("local", None, text, [], "", GenerationSettings.preset(True), Session()))
    assert views == [] and store.user("local").list() == []

    images = ApiImageStore(tmp_path / "api_images", ImageLimits())
    with pytest.raises(APIRequestError, match="The message is empty") as refused:
        parse_messages([{"role": "user", "content": text}], ServiceConfig(history_dir=tmp_path), images)
    assert refused.value.param == "messages[0].content"

    from qwen_chat.engine.text.prompt import build_prompt

    with pytest.raises(InvalidInput, match="The message is empty"):
        build_prompt(None, [ChatMessage(role="user", text=text)], enable_thinking=True, image_token_budget=1024,
                     context_length=4096, max_new_tokens=64)


@pytest.mark.parametrize("text", NOT_BLANK.values(), ids=NOT_BLANK.keys())
def test_visible_text_is_not_blank(text, tmp_path):
    assert not is_blank(text)
    images = ApiImageStore(tmp_path / "api_images", ImageLimits())
    [message] = parse_messages([{"role": "user", "content": text}], ServiceConfig(history_dir=tmp_path), images)
    assert message.text == text


def test_none_and_empty_are_blank():
    assert is_blank(None) and is_blank("")
