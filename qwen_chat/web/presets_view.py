"""Presets on the chat page: the Preset menu and the thinking token budget under Settings (``history.presets``).

What a user sees:

* **Preset** lists the user's own presets (never another user's: every event reads the presets of the
  request's user); choosing one loads its system prompt, Thinking switch, sliders and thinking budget;
* **Save preset** saves the current settings under the name typed in **Preset name** (the same name replaces
  that preset); **Make default** makes the chosen preset the one every new chat starts with; **Delete preset**
  deletes it;
* **Thinking budget** (tokens; empty: none): with Thinking on, after that many reasoning tokens the model
  closes its reasoning and answers (the API's ``thinking_token_budget``);
* the chosen preset and all settings are saved with each chat (``conversation.settings``) and come back when
  the chat is opened again; a new chat starts with the default preset (or the page's own defaults).

``PresetControls`` holds the components; ``render`` lays them out (inside the Settings accordion) and
``wire`` connects them.  The plain functions (``apply_preset``, ``restore_settings``, ``parse_budget``) are
tested without a browser.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, replace
from typing import Any, Optional

import gradio as gr

from qwen_chat.chat_types import THINKING_TOKEN_BUDGET_RANGE, ChatError, InvalidInput
from qwen_chat.history.presets import Preset, Presets
from qwen_chat.web.controls import build_settings
from qwen_chat.web.handlers import Session
from qwen_chat.web.render import safe_markdown

NO_PRESET = ""


@dataclass
class PresetControls:
    """The preset components (``gr`` components; ``render`` fills them in)."""

    preset: Any = None  # Dropdown of the user's preset names ("" = none)
    budget: Any = None  # Textbox: thinking token budget ("" = none)
    name: Any = None  # Textbox: name to save the current settings under
    save: Any = None
    make_default: Any = None
    delete: Any = None
    notice: Any = None  # Markdown under the preset buttons: what the last preset action did (or why not)


def parse_budget(value: Any) -> Optional[int]:
    """Thinking budget box -> None (empty) or a whole number of tokens in ``THINKING_TOKEN_BUDGET_RANGE``.

    Raises:
        InvalidInput: anything else, naming the range.
    """
    low, high = THINKING_TOKEN_BUDGET_RANGE
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if number != number or number != int(number) or not low <= number <= high:
        raise InvalidInput(f"the thinking budget must be a whole number of tokens in [{low}, {high}] "
                           f"(or empty for none), got {value!r}")
    return int(number)


def preset_choices(book: Any) -> list[tuple[str, str]]:
    """The Preset menu's (label, value) choices: "No preset", then the user's presets, the default marked."""
    return [("No preset", NO_PRESET)] + [
        (p.name + (" (default)" if p.name == book.default else ""), p.name) for p in book.presets]


def apply_preset(preset: Preset) -> dict[str, Any]:
    """The control values a preset sets, keyed like ``conversation.settings`` (``turns.settings_record``)."""
    return {"system_prompt": preset.system_prompt, "enable_thinking": preset.enable_thinking,
            "max_new_tokens": preset.max_new_tokens, "temperature": preset.temperature, "top_p": preset.top_p,
            "top_k": preset.top_k, "presence_penalty": preset.presence_penalty,
            "thinking_token_budget": preset.thinking_token_budget, "preset": preset.name}


def restore_settings(saved: Any) -> dict[str, Any]:
    """The control values saved with a chat (``conversation.settings``), only the keys present with a value of
    the right kind; a chat saved before budgets existed gets "no budget" (None); the seed is not restored (empty
    means a fresh one)."""
    saved = saved if isinstance(saved, dict) else {}
    kinds = {"system_prompt": str, "enable_thinking": bool, "max_new_tokens": (int, float),
             "temperature": (int, float), "top_p": (int, float), "top_k": (int, float),
             "presence_penalty": (int, float), "thinking_token_budget": (int, type(None)), "preset": str}
    values = {k: saved[k] for k, kind in kinds.items() if k in saved and isinstance(saved[k], kind)
              and not (kind != bool and isinstance(saved[k], bool))}
    if saved and "thinking_token_budget" not in saved:  # saved before budgets existed: it had none
        values["thinking_token_budget"] = None
    return values


def render() -> PresetControls:
    """Lay out the preset controls (call inside the Settings accordion)."""
    p = PresetControls()
    p.budget = gr.Textbox(label="Thinking budget (tokens of reasoning, then the answer; empty: no budget)",
                          value="", placeholder="no budget", max_lines=1, elem_id="thinking-budget")
    with gr.Group(elem_id="presets"):
        p.preset = gr.Dropdown(choices=[("No preset", NO_PRESET)], value=NO_PRESET, label="Preset",
                               elem_id="preset", interactive=True)
        p.name = gr.Textbox(label="Preset name", max_lines=1, placeholder="name for the current settings",
                            elem_id="preset-name")
        with gr.Row():
            p.save = gr.Button("Save preset", size="sm", elem_id="save-preset", min_width=80)
            p.make_default = gr.Button("Make default", size="sm", elem_id="default-preset", min_width=80)
            p.delete = gr.Button("Delete preset", size="sm", elem_id="delete-preset", min_width=80)
        p.notice = gr.Markdown("", elem_id="preset-notice", latex_delimiters=[])  # next to what it is about
    return p


def wire(c: Any, p: PresetControls, ctl: Any, user_of: Any) -> None:
    """Connect the preset controls of page ``c`` (``page_events.Page``) to the user's presets (``ctl.store``);
    ``user_of(request)`` names the request's user."""
    fields = {"system_prompt": c.system_prompt, "enable_thinking": c.thinking, "max_new_tokens": c.max_new_tokens,
              "temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k,
              "presence_penalty": c.presence_penalty}
    outputs = [*fields.values(), p.budget, p.preset, p.name, c.session, p.notice]
    private = dict(api_visibility="private", show_progress="hidden")

    def presets_of(request: gr.Request) -> Presets:
        return Presets(ctl.store.user(user_of(request)))

    def shown(values: dict, session: Optional[Session], book: Any) -> dict:
        """Updates putting ``values`` (settings keys) into the controls, the tab's session and the menu."""
        session = session or Session()
        out: dict = {fields[k]: values[k] for k in fields if k in values}
        if "thinking_token_budget" in values:
            budget = values["thinking_token_budget"]
            session.thinking_budget = budget
            out[p.budget] = "" if budget is None else str(budget)
        name = values.get("preset", NO_PRESET)
        session.preset = name if book.get(name) is not None else NO_PRESET
        out[p.preset] = gr.update(choices=preset_choices(book), value=session.preset)
        out[p.name] = session.preset
        out[c.session] = session
        return out

    def choose(name, session, request: gr.Request):
        # The menu closed on the preset it had (Esc, a click outside): the name box keeps what is being typed
        # in it (it was overwritten with the preset's name, and a Save right after found it empty).
        same = session is not None and name == session.preset
        book = presets_of(request).read()
        preset = book.get(name)
        if preset is None:
            session = session or Session()
            session.preset = NO_PRESET
            out = {c.session: session, p.name: ""}
        else:
            out = {**shown(apply_preset(preset), session, book), p.notice: _said("Preset \u201c{}\u201d loaded.", name)}
        if same:
            del out[p.name]
        return out

    def save(name, system_prompt, thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, budget,
             session, request: gr.Request):
        try:
            settings = build_settings(thinking, max_new_tokens, temperature, top_p, top_k, presence_penalty, "")
            settings = replace(settings, thinking_token_budget=parse_budget(budget))
            preset = Preset.make(name, system_prompt or "", settings)
            book = presets_of(request).save(preset)
        except ChatError as e:
            return {p.notice: _warn(str(e))}
        saved = _said("Preset \u201c{}\u201d saved.", preset.name)
        return {**shown({"preset": preset.name}, session, book), p.notice: saved}

    def make_default(name, session, request: gr.Request):
        try:
            book = presets_of(request).set_default(name or None)
        except ChatError as e:
            return {p.notice: _warn(str(e))}
        note = (_said("New chats start with \u201c{}\u201d.", name) if name
                else "New chats start with the page's defaults.")
        return {**shown({"preset": name}, session, book), p.notice: note}

    def delete(name, session, request: gr.Request):
        try:
            if not name:
                raise InvalidInput("choose a preset to delete")
            book = presets_of(request).delete(name)
        except ChatError as e:
            return {p.notice: _warn(str(e))}
        deleted = _said("Preset \u201c{}\u201d deleted.", name)
        return {**shown({"preset": NO_PRESET}, session, book), p.notice: deleted}

    def budget_changed(value, session):
        session = session or Session()
        try:
            session.thinking_budget = parse_budget(value)
        except ChatError as e:
            session.thinking_budget = None
            return {c.session: session, p.notice: _warn(str(e))}
        return {c.session: session}

    def follow(conv_id, session, request: gr.Request):
        """The open chat changed (opened, reloaded, new): its saved settings, or the default preset for none."""
        if session is not None and not session.opened("settings", conv_id, skip_stale=True):
            return gr.skip()  # the same chat: keep what the user set meanwhile
        history = ctl.store.user(user_of(request))
        book = Presets(history).read()
        if conv_id:
            try:
                return shown(restore_settings(history.load(conv_id).settings), session, book)
            except ChatError:
                pass
        default = book.get(book.default) if book.default else None
        values = apply_preset(default) if default is not None else {"preset": NO_PRESET}
        return shown(values, session, book)

    p.preset.input(choose, [p.preset, c.session], outputs, **private)
    p.save.click(save, [p.name, c.system_prompt, c.thinking, c.max_new_tokens, c.temperature, c.top_p, c.top_k,
                        c.presence_penalty, p.budget, c.session], outputs, **private)
    p.make_default.click(make_default, [p.preset, c.session], outputs, **private)
    p.delete.click(delete, [p.preset, c.session], outputs, **private)
    p.budget.change(budget_changed, [p.budget, c.session], [c.session, p.notice], **private)
    c.conv_id.change(follow, [c.conv_id, c.session], outputs, **private)

    def new_chat(session, request: gr.Request):
        """New chat (the button or the chat's trash icon): the default preset, also when the chat shown was a new
        one already (its id stays "", and Gradio then need not fire the id's change)."""
        if session is not None:
            session.followed.pop("settings", None)
        return follow("", session, request)

    for start in (c.new_btn.click, c.chatbot.clear):
        start(new_chat, [c.session], outputs, **private)
    kept = "(id) => [id || (() => { try { return sessionStorage.getItem('qwen-chat-open-conversation') || ''; } " \
           "catch (e) { return ''; } })()]"

    def loaded(conv_id, request: gr.Request):
        return follow(conv_id, None, request)

    c.page.load(loaded, [c.conv_id], outputs, js=kept, **private)


def _said(template: str, name: str) -> str:
    """A notice naming a preset (user text: made inert with ``render.safe_markdown``)."""
    return safe_markdown(template.format(name))


def _warn(message: str) -> str:
    gr.Warning(html.escape(message))
    return safe_markdown(message)
