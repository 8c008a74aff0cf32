"""The page's sampling controls: their defaults and the validated ``GenerationSettings`` they make.

* ``page_defaults(demo)``: what the Settings panel starts with.  For the demo model (random weights) thinking is
  off and replies stop after ``DEMO_MAX_NEW_TOKENS`` tokens, so a first-time user sees an answer within seconds
  on a CPU instead of a minute of gibberish reasoning ended by the token limit; a real checkpoint starts in
  thinking mode with the model card's preset and ``GenerationSettings``' default max new tokens;
* ``preset_values(thinking)``: the Qwen3.5 preset loaded into the sliders when Thinking is switched;
* ``with_session_choices``: the tab's thinking token budget (a control kept in the tab's ``Session``) added;
* ``build_settings`` / ``parse_seed``: the controls' values -> ``GenerationSettings`` (the UI's one check; the
  engine checks again as part of its contract).

No Gradio objects here, no torch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from qwen_chat.chat_types import GenerationSettings, InvalidInput

#: Max new tokens the page starts with for the demo model: about 6 s of decoding on 2 CPU cores.
DEMO_MAX_NEW_TOKENS = 256


def page_defaults(demo: bool) -> GenerationSettings:
    """The settings the page's controls start with: the thinking preset for a real model; for the demo model
    the non-thinking preset with ``DEMO_MAX_NEW_TOKENS`` (see the module docstring)."""
    if demo:
        return replace(GenerationSettings.preset(False), max_new_tokens=DEMO_MAX_NEW_TOKENS)
    return GenerationSettings.preset(True)


def preset_values(thinking: bool) -> tuple[float, float, int, float]:
    """(temperature, top_p, top_k, presence_penalty) of the Qwen3.5 preset for the mode (``chat_types``)."""
    p = GenerationSettings.preset(bool(thinking))
    return p.temperature, p.top_p, p.top_k, p.presence_penalty


def parse_seed(value: Any) -> Optional[int]:
    """Seed box value -> None (empty: fresh random seed) or an int.  Raises ``InvalidInput`` otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"seed must be a whole number in [0, 2**63-1], got {value!r}") from None
    if number != number or number != int(number):
        raise InvalidInput(f"seed must be a whole number in [0, 2**63-1], got {value!r}")
    return int(number)


def build_settings(thinking: bool, max_new_tokens: Any, temperature: Any, top_p: Any, top_k: Any,
                   presence_penalty: Any, seed: Any) -> GenerationSettings:
    """Validated ``GenerationSettings`` from the UI controls.  Raises ``InvalidInput`` naming the bad value."""
    try:
        settings = GenerationSettings(
            max_new_tokens=int(max_new_tokens) if float(max_new_tokens) == int(float(max_new_tokens))
            else float(max_new_tokens),
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k) if float(top_k) == int(float(top_k)) else float(top_k),
            presence_penalty=float(presence_penalty),
            seed=parse_seed(seed),
            enable_thinking=bool(thinking),
        )
    except (TypeError, ValueError, OverflowError):
        raise InvalidInput("every sampling control needs a number") from None
    return settings.validate()


def with_session_choices(settings: GenerationSettings, session: Any) -> GenerationSettings:
    """``settings`` with the tab's thinking token budget (``session.thinking_budget``: tokens of reasoning
    before the engine closes the thinking block; None = no budget), validated.  A budget only applies with
    thinking on (the engine ignores it otherwise).

    Raises:
        InvalidInput: a budget outside ``chat_types.THINKING_TOKEN_BUDGET_RANGE``.
    """
    budget = getattr(session, "thinking_budget", None)
    if budget is None or settings.thinking_token_budget is not None:
        return settings
    return replace(settings, thinking_token_budget=int(budget)).validate()
