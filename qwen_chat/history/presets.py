"""Presets: a user's named settings (system prompt, sampling, thinking on/off and a thinking token budget).

Each user's presets are one JSON file next to their conversations, never readable through another user's
``UserHistory`` (the path is built from the ``UserHistory``'s own folder)::

    users/<user_id>/presets.json
    {"schema_version": 1, "default": "Short answers" | null,
     "presets": [{"name": "Short answers", "system_prompt": "Answer in one sentence.", "enable_thinking": false,
                  "thinking_token_budget": null, "max_new_tokens": 512, "temperature": 0.7, "top_p": 0.8,
                  "top_k": 20, "presence_penalty": 1.5}]}

``default`` names the preset a new chat starts with (None: the page's own defaults).  Every change is a locked
read-modify-write written atomically (``files.write_atomic``), as the conversation files are; an unreadable
file is set aside into ``corrupt/`` and reads as "no presets".  No torch, no Gradio.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from qwen_chat.chat_types import GenerationSettings, InvalidInput
from qwen_chat.history.errors import unavailable
from qwen_chat.history.files import LockTable, exclusive_lock, set_aside, write_atomic

log = logging.getLogger(__name__)

PRESETS_FILE = "presets.json"
MAX_PRESETS = 50
NAME_MAX_CHARS = 60
SYSTEM_PROMPT_MAX_CHARS = 20_000
_LOCKS = LockTable()  # only this module locks presets.lock


@dataclass(frozen=True)
class Preset:
    """One named preset.  Units and ranges are ``GenerationSettings``' (``chat_types``): ``max_new_tokens`` and
    ``thinking_token_budget`` in tokens (budget None: no budget; it applies with thinking on only).

    Raises:
        InvalidInput: ``Preset.make`` for a blank or too long name, a too long system prompt or a value out of
        its range.
    """

    name: str
    system_prompt: str
    enable_thinking: bool
    thinking_token_budget: Optional[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    presence_penalty: float

    @classmethod
    def make(cls, name: Any, system_prompt: Any, settings: GenerationSettings) -> "Preset":
        """A validated preset named ``name`` from ``settings`` (validated again) and ``system_prompt``."""
        if not isinstance(name, str) or not " ".join(name.split()):
            raise InvalidInput("give the preset a name")
        name = " ".join(name.split())
        if len(name) > NAME_MAX_CHARS:
            raise InvalidInput(f"the preset name is too long ({len(name)} characters, at most {NAME_MAX_CHARS})")
        if not isinstance(system_prompt, str) or len(system_prompt) > SYSTEM_PROMPT_MAX_CHARS:
            raise InvalidInput(f"the system prompt of a preset is text of at most {SYSTEM_PROMPT_MAX_CHARS} characters")
        s = settings.validate()
        return cls(name, system_prompt, bool(s.enable_thinking), s.thinking_token_budget, int(s.max_new_tokens),
                   float(s.temperature), float(s.top_p), int(s.top_k), float(s.presence_penalty))

    def settings(self) -> GenerationSettings:
        """The preset's ``GenerationSettings`` (seed None: a fresh random seed per reply)."""
        return GenerationSettings(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                  top_p=self.top_p, top_k=self.top_k, presence_penalty=self.presence_penalty,
                                  enable_thinking=self.enable_thinking,
                                  thinking_token_budget=self.thinking_token_budget)

    @classmethod
    def from_dict(cls, data: Any) -> "Preset":
        """Parse one saved preset.  Raises ``ValueError`` / ``InvalidInput`` when malformed or out of range."""
        if not isinstance(data, dict):
            raise ValueError("a preset is not an object")
        try:
            settings = GenerationSettings(
                max_new_tokens=data["max_new_tokens"], temperature=data["temperature"], top_p=data["top_p"],
                top_k=data["top_k"], presence_penalty=data["presence_penalty"],
                enable_thinking=data["enable_thinking"], thinking_token_budget=data["thinking_token_budget"])
            return cls.make(data["name"], data["system_prompt"], settings)
        except KeyError as e:
            raise ValueError(f"a preset lacks {e}") from None


@dataclass(frozen=True)
class PresetBook:
    """A user's presets (in the order saved) and the name of the default one (None: none)."""

    presets: tuple[Preset, ...] = ()
    default: Optional[str] = None

    def get(self, name: str) -> Optional[Preset]:
        """The preset called ``name``, or None."""
        return next((p for p in self.presets if p.name == name), None)

    def names(self) -> list[str]:
        """The presets' names, in the order saved."""
        return [p.name for p in self.presets]


class Presets:
    """The presets of one ``store.UserHistory`` (its folder's ``presets.json``).  Thread- and process-safe.

    Errors: ``InvalidInput`` for a bad preset, an unknown name or too many presets; ``HistoryUnavailable`` from a
    failing disk while writing (the saved file is then unchanged).
    """

    def __init__(self, history: Any) -> None:
        self.path = history.folder / PRESETS_FILE
        self._lock = history.folder / "locks" / "presets.lock"
        self._corrupt = history.folder / "corrupt"

    def read(self) -> PresetBook:
        """The saved presets; an unreadable file is set aside (logged) and reads as no presets."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return PresetBook()
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict) or data.get("schema_version") != 1 or not isinstance(
                    data.get("presets"), list):
                raise ValueError("not a presets file of schema version 1")
            presets = tuple(Preset.from_dict(p) for p in data["presets"])
            default = data.get("default")
            return PresetBook(presets, default if default in [p.name for p in presets] else None)
        except (ValueError, InvalidInput) as e:
            with exclusive_lock(self._lock, _LOCKS):
                if self.path.exists() and self.path.read_bytes() == raw:
                    set_aside(self.path, self._corrupt, str(e) or type(e).__name__)
            return PresetBook()

    def _change(self, change: Callable[[PresetBook], PresetBook]) -> PresetBook:
        try:
            with exclusive_lock(self._lock, _LOCKS):
                book = change(self.read())
                data = {"schema_version": 1, "default": book.default, "presets": [asdict(p) for p in book.presets]}
                write_atomic(self.path, json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8"))
        except OSError as e:
            log.warning("presets %s: cannot save them: %s", self.path, e)
            raise unavailable("save the presets", e) from None
        return book

    def save(self, preset: Preset, make_default: bool = False) -> PresetBook:
        """Add ``preset`` (or replace the one with its name, in place); with ``make_default`` make it the default.

        Raises:
            InvalidInput: not a ``Preset``, or already ``MAX_PRESETS`` others.
        """
        if not isinstance(preset, Preset):
            raise InvalidInput("not a preset")

        def change(book: PresetBook) -> PresetBook:
            names = book.names()
            if preset.name in names:
                presets = tuple(preset if p.name == preset.name else p for p in book.presets)
            elif len(names) >= MAX_PRESETS:
                raise InvalidInput(f"at most {MAX_PRESETS} presets: delete one first")
            else:
                presets = (*book.presets, preset)
            return PresetBook(presets, preset.name if make_default else book.default)

        return self._change(change)

    def delete(self, name: str) -> PresetBook:
        """Delete the preset called ``name`` (the default too: then there is none).  Raises ``InvalidInput`` for an
        unknown name."""
        def change(book: PresetBook) -> PresetBook:
            if book.get(name) is None:
                raise InvalidInput(f"there is no preset called {name!r}")
            return PresetBook(tuple(p for p in book.presets if p.name != name),
                              None if book.default == name else book.default)

        return self._change(change)

    def set_default(self, name: Optional[str]) -> PresetBook:
        """Make ``name`` the default preset (None: no default).  Raises ``InvalidInput`` for an unknown name."""
        def change(book: PresetBook) -> PresetBook:
            if name is not None and book.get(name) is None:
                raise InvalidInput(f"there is no preset called {name!r}")
            return PresetBook(book.presets, name)

        return self._change(change)
