"""Math in chat messages: which text is typeset by KaTeX, and the rule that keeps dollar amounts literal.

The Chatbot typesets with the KaTeX that Gradio bundles (``LATEX_DELIMITERS``, its ``latex_delimiters``; Gradio
loads KaTeX only when a message holds one of them, so a page without math downloads none of it):
``\\[...\\]`` as display math, ``\\(...\\)`` inline.  ``$$`` is not a delimiter in the browser: Gradio pairs
delimiters over the whole message before it parses Markdown, so a ``$$`` inside code (``echo $$``, the shell's
process id) paired with a formula's ``$$`` after it and broke the code block.  ``DisplayDollars`` writes the
model's ``$$...$$`` outside code as ``\\[...\\]`` instead (pairs in text order; an unpaired last ``$$`` stays
text), so a ``$$`` in code is never paired.  KaTeX runs with ``throwOnError`` off, so a
malformed formula shows as its source text (in KaTeX's error colour) and the rest of the message renders; KaTeX
never typesets inside ``code``/``pre`` elements.

A single ``$`` is *not* a delimiter in the browser: ``$5 to $12.50`` would become a formula.  Instead
``dollar_math`` rewrites the model's ``$...$`` spans that are math by this rule (Pandoc's ``tex_math_dollars``
rule, Pandoc User's Guide, "Math", plus two additions) into ``\\(...\\)``:

1. the opening ``$`` is not escaped (``\\$``), not part of ``$$``, and is followed by a non-space character;
2. the closing ``$`` is the next ``$`` on the same line, is preceded by a non-space character, is not escaped,
   and is not followed by a digit;
3. (addition) the span holds no other ``$`` and lies on one line; (addition) a ``$`` that cannot close starts
   the search again from itself;
4. (addition) what lies between looks like math: it holds a backslash, a digit or one of ``MATH_MARKS``
   (``^ _ = + - * / < > ( ) [ ] { } | ! '``), or is at most ``SHORT_SPAN`` characters (``$x$``, ``$xy$``).
   Words between two dollars (``$hello world$``, what a model with random weights often writes, or prose
   quoting two ``$`` signs) stay text instead of turning into italic math.

So ``$5 to $12.50``, ``$5-$10``, ``$5/$10``, ``$20,000 and $30,000`` and ``costs $5 and $10`` stay text (the
second ``$`` follows a space or is followed by a digit), while ``$x^2$`` and ``$\\alpha + \\beta$`` are math.
``render.safe_markdown(..., math=True)`` applies the rewrite outside code spans and fenced code only, and only
to the model's text (reasoning and answer); a user's own ``$`` stays as typed, so the edit box shows it.
Known limit: code holding ``\\[`` or ``\\(`` in a message with a formula after it can still pair across the
code (the same pre-pass); a user's own ``$$...$$`` shows as typed.

No Gradio objects here.
"""
from __future__ import annotations

#: Gradio Chatbot ``latex_delimiters``: display ``\[``, inline ``\(`` (never ``$$`` or a single ``$``: the
#: model's are rewritten outside code, ``DisplayDollars`` and ``dollar_math``).
LATEX_DELIMITERS = [
    {"left": "\\[", "right": "\\]", "display": True},
    {"left": "\\(", "right": "\\)", "display": False},
]


#: Characters that make the text between two dollars math (rule 4 of the module docstring); digits count too.
MATH_MARKS = frozenset("\\^_=+-*/<>()[]{}|!'")
#: Spans this short (characters between the dollars) are math whatever they hold: ``$x$``, ``$xy$``, ``$ab$``.
SHORT_SPAN = 2


def looks_like_math(inner: str) -> bool:
    """Rule 4 of the module docstring for the text between two dollars."""
    return len(inner) <= SHORT_SPAN or any(ch in MATH_MARKS or ch.isdigit() for ch in inner)


def _escaped(line: str, i: int) -> bool:
    """True when ``line[i]`` is preceded by an odd number of backslashes."""
    n = 0
    while i - n - 1 >= 0 and line[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _single_dollars(line: str) -> list[int]:
    """Positions of the ``$`` of ``line`` that are not escaped and not part of ``$$``."""
    out = []
    for i, ch in enumerate(line):
        if ch != "$" or _escaped(line, i):
            continue
        if (i > 0 and line[i - 1] == "$") or (i + 1 < len(line) and line[i + 1] == "$"):
            continue
        out.append(i)
    return out


def math_spans(line: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every ``$...$`` span of one line that is math by the module's rule (``line[start]``
    and ``line[end - 1]`` are the dollars)."""
    dollars = _single_dollars(line)
    spans, k = [], 0
    while k + 1 < len(dollars):
        start, end = dollars[k], dollars[k + 1]
        opens = start + 1 < len(line) and not line[start + 1].isspace()
        closes = (not line[end - 1].isspace() and end - 1 > start
                  and not (end + 1 < len(line) and line[end + 1].isdigit()))
        if opens and closes and looks_like_math(line[start + 1:end]):
            spans.append((start, end + 1))
            k += 2
        else:
            k += 1
    return spans


def dollar_math(text: str) -> str:
    """``text`` with each ``$...$`` that is math (``math_spans``) written as ``\\(...\\)``; everything else,
    dollar amounts included, unchanged.  Works line by line (an inline formula never spans lines)."""
    lines = []
    for line in text.split("\n"):
        spans = math_spans(line) if "$" in line else []
        out, pos = [], 0
        for start, end in spans:
            out.append(line[pos:start])
            out.append("\\(" + line[start + 1:end - 1] + "\\)")
            pos = end
        out.append(line[pos:])
        lines.append("".join(out))
    return "\n".join(lines)


def display_dollar_positions(part: str) -> list[int]:
    """Positions of the ``$$`` pairs of characters in ``part`` (left to right, not overlapping, not escaped)."""
    out, i = [], part.find("$$")
    while i >= 0:
        if not _escaped(part, i):
            out.append(i)
        i = part.find("$$", i + 2)
    return out


class DisplayDollars:
    """Writes ``$$`` as ``\\[`` and ``\\]`` in turn in the parts of one message outside code, called on them in
    text order; ``total``: the ``$$`` of the message outside code (``display_dollar_positions`` summed), of
    which an unpaired last one stays ``$$`` (text: ``$$`` is no delimiter in the browser)."""

    def __init__(self, total: int) -> None:
        self.pairs_end = total - total % 2
        self.seen = 0

    def __call__(self, part: str) -> str:
        out, pos = [], 0
        for i in display_dollar_positions(part):
            if self.seen >= self.pairs_end:
                break
            out.append(part[pos:i])
            out.append("\\[" if self.seen % 2 == 0 else "\\]")
            pos, self.seen = i + 2, self.seen + 1
        out.append(part[pos:])
        return "".join(out)
