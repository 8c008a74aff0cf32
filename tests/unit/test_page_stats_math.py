"""Per-reply statistics (history/reply_stats, web/stats_view), the dollar rule of math rendering
(web/math_render), the history JSON with and without statistics, and the Markdown download (history/export_md)."""
from __future__ import annotations

import json
import re

import pytest

from qwen_chat.chat_types import StreamUpdate
from qwen_chat.history.export_md import conversation_markdown, download_name
from qwen_chat.history.records import Conversation, StoredMessage
from qwen_chat.history.reply_stats import ReplyStats
from qwen_chat.history.store import HistoryStore
from qwen_chat.web.math_render import LATEX_DELIMITERS, dollar_math
from qwen_chat.web.render import chatbot_messages, safe_markdown
from qwen_chat.web.stats_view import stats_line

#: Dollar amounts as users and models write them: none of them may become a formula.
MONEY = ["$5 to $12.50", "costs $5 and $10", "$5-$10", "$5/$10", "$20,000 and $30,000", "Pay $5.",
         "between $1,000 and $2,000 a month", "it was $5, now $7", "$5 or more, $", "price: $ 5 and $ 6",
         "\\$x\\$ stays", "$5 and $10 <script>alert(1)</script>",
         "$hello world$", "say $Beautiful$ twice", "the $ours and theirs$ deal"]  # words, not math
MATH = [("$x^2$", "\\(x^2\\)"), ("area $A = \\pi r^2$ here", "area \\(A = \\pi r^2\\) here"),
        ("$5, and $x$ is", "$5, and \\(x\\) is"), ("$\\alpha$ and $\\beta$", "\\(\\alpha\\) and \\(\\beta\\)"),
        ("$f(x)$ and $n$", "\\(f(x)\\) and \\(n\\)"), ("$xy$", "\\(xy\\)"), ("$x_1 y$", "\\(x_1 y\\)")]


@pytest.mark.parametrize("text", MONEY)
def test_dollar_amounts_stay_text(text):
    assert dollar_math(text) == text
    shown = safe_markdown(text, math=True)
    assert "\\(" not in shown and "$$" not in shown


@pytest.mark.parametrize("text, expected", MATH)
def test_dollar_math_becomes_inline_math(text, expected):
    assert dollar_math(text) == expected


def test_math_never_inside_code_and_only_for_the_model():
    assert safe_markdown("`$x$` and $y$", math=True) == "`$x$` and \\(y\\)"
    assert safe_markdown("```\necho $a$ $HOME\n```", math=True) == "```\necho $a$ $HOME\n```"
    assert safe_markdown("$x$") == "$x$"  # a user's own text stays as typed
    assert dollar_math("$a\n$b") == "$a\n$b"  # never across lines
    # display formulas: $$...$$ outside code becomes \[...\], so a $$ in code never pairs with a formula's
    assert safe_markdown("```\necho $$\n```\n\ntext $$x^2$$ end", math=True) == \
        "```\necho $$\n```\n\ntext \\[x^2\\] end"
    assert safe_markdown("$$\n\\int_0^1 x\n$$ `$$` $$a$$ $$b", math=True) == "\\[\n\\int_0^1 x\n\\] `$$` \\[a\\] $$b"
    assert "$$" not in [d["left"] for d in LATEX_DELIMITERS]  # an unpaired $$ (the last one) stays text


def fake_clock(times):
    it = iter(times)
    return lambda: next(it)


def test_reply_stats_follow_the_engine_counts_and_times():
    stats = ReplyStats(clock=fake_clock([10.0, 10.5, 11.0, 12.0, 12.0]))
    stats.see(StreamUpdate(answer_delta="a", prompt_tokens=30, completion_tokens=1, ttft_s=0.25, cached_tokens=20))
    assert stats.record()["tokens_per_s"] is None  # one token: no speed yet
    stats.see(StreamUpdate(answer_delta="b", prompt_tokens=30, completion_tokens=3, cached_tokens=20))
    stats.see(StreamUpdate(answer_delta="c", prompt_tokens=30, completion_tokens=5, cached_tokens=20))
    stats.see(StreamUpdate(finish_reason="stop", prompt_tokens=30, completion_tokens=5, cached_tokens=20))
    assert stats.record() == {"prompt_tokens": 30, "cached_tokens": 20, "completion_tokens": 5, "ttft_s": 0.25,
                              "tokens_per_s": 2.67}  # (5 - 1) tokens / (12.0 - 10.5) s
    assert stats_line(stats.record()) == ("5 tokens · first token 0.25 s · 2.7 tokens/s · prompt 30 tokens, "
                                          "20 cached")
    wall = ReplyStats(clock=fake_clock([1.0, 1.75]))  # no engine ttft: wall time to the first token
    wall.see(StreamUpdate(reasoning_delta="r", completion_tokens=1))
    assert wall.record()["ttft_s"] == 0.75


def test_stats_are_saved_with_the_reply_and_old_files_open_unchanged(tmp_path):
    store = HistoryStore(tmp_path)
    history = store.user("local")
    conv = history.create()
    history.append_message(conv.id, role="user", text="q")
    ref = history.append_message(conv.id, role="assistant", text="", status="streaming")
    record = {"prompt_tokens": 4, "cached_tokens": 0, "completion_tokens": 2, "ttft_s": 0.1, "tokens_per_s": 9.5}
    history.update_message(conv.id, ref, text="a b", status="complete", stats=record)
    path = next((tmp_path / "users" / "local" / "conversations").glob("*.json"))
    data = json.loads(path.read_text())
    assert data["messages"][1]["stats"] == record and "stats" not in data["messages"][0]
    shown = chatbot_messages(history.load(conv.id).messages, None)
    assert shown[-1]["metadata"] == {"status": "done"} and stats_line(record) in shown[-1]["content"][0]["text"]
    old = dict(data, messages=[{k: v for k, v in m.items() if k != "stats"} for m in data["messages"]])
    assert Conversation.from_dict(old).messages[1].stats is None  # a file from before statistics
    assert Conversation.from_dict(old).to_dict() == old  # and it is saved back as it was
    with pytest.raises(Exception, match="stats.completion_tokens"):
        StoredMessage.new("assistant", "x", stats={"completion_tokens": "many"})


def test_markdown_download_and_its_name():
    conv = Conversation(id="a" * 32, title="Cats: a <b>study</b>?")
    conv.messages = [StoredMessage.new("user", "Hi $5"),
                     StoredMessage.new("assistant", "Hello", reasoning="think",
                                       stats={"prompt_tokens": 3, "completion_tokens": 1})]
    text = conversation_markdown(conv, stats_line)
    assert text.startswith("# Cats: a <b>study</b>?\n") and "**You**\n\nHi $5" in text
    assert "<summary>Thinking</summary>" in text and "*1 token · prompt 3 tokens, 0 cached*" in text
    assert download_name(conv.title, ".zip") == "Cats_ a _b_study_b.zip"
    assert download_name("   ", ".md") == "conversation.md"
    assert re.fullmatch(r"[\w .,()+-]+", download_name("../../etc/passwd", ".zip"))


def test_one_reply_per_conversation_and_at_most_four_running_per_tab(tmp_path):
    from qwen_chat.chat_types import GenerationSettings, InvalidInput
    from qwen_chat.web.handlers import ChatController, Session
    from qwen_chat.web.live_turns import MAX_RUNNING_PER_TAB
    from tests.support.fake_backend import FakeBackend

    backend = FakeBackend.for_ui(answer=" ".join(f"w{i}" for i in range(400)), step_delay_s=0.01, capacity=10)
    ctl = ChatController(backend, HistoryStore(tmp_path), save_interval_s=0.05, ui_interval_s=0.0)
    session = Session(tab="tab-1")
    settings = GenerationSettings.preset(False)
    started = []
    for i in range(MAX_RUNNING_PER_TAB):
        gen = ctl.send("local", None, f"story {i}", [], "", settings, session)
        view = next(v for v in gen if v.conv_id)
        gen.close()  # New chat: the reply runs on
        session.cancel = None
        started.append(view.conv_id)
    with pytest.raises(InvalidInput, match="being written at once"):
        list(ctl.send("local", None, "one too many", [], "", settings, session))
    with pytest.raises(InvalidInput, match="still being written in this conversation"):
        list(ctl.send("local", started[0], "again", [], "", settings, Session(tab="tab-2")))
    assert ctl.live.running("local") == frozenset(started) and ctl.live.running("bob") == frozenset()
    assert ctl.close_tab("tab-1") == MAX_RUNNING_PER_TAB and ctl.live.wait_idle(30)
    assert {ctl.store.user("local").load(c).messages[-1].status for c in started} == {"stopped"}
