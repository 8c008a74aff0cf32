"""The chat page's kept versions, conversation menu and presets: components, events and the page script.

``render_tag_filter`` (sidebar, above the list) and ``render_hidden`` (the channels between the page script and
the server) lay out what ``ui.py`` does not; ``wire_extras`` connects them, with the presets
(``presets_view``), after ``page_events.wire``.

The page script (``page.js``, given to Gradio as ``PAGE_HEAD``) draws what Gradio's components cannot: the
``< 2/3 >`` switch and "Fork" under each message (from ``branch_view.branch_rows``, kept in the hidden
``#branch-rows`` box) and the "⋯" menu on each conversation entry.  It sends a command by putting its JSON in
``window.qcPage.command`` and clicking a hidden button (``#branch-go`` for the messages, ``#list-go`` for the
list); the button's event reads the JSON through its ``js`` function.  The menu's Export is the one-click
Download of that entry (``ChatController.download``: ``<title>.zip``): the zip goes into the hidden
``#menu-download`` file, whose link the browser then follows (``SAVE_JS``).
"""
from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import gradio as gr

from qwen_chat.chat_types import ChatError
from qwen_chat.web import presets_view
from qwen_chat.web.branch_view import BranchActions, branch_json
from qwen_chat.web.handlers import Session
from qwen_chat.web.page_events import NARROW_PX
from qwen_chat.web.page_live import download_update
from qwen_chat.web.render import safe_markdown
from qwen_chat.web.sidebar import ALL_TAGS, ListActions, parse_command, tag_choices

log = logging.getLogger(__name__)

PAGE_HEAD = "<script>\n" + (Path(__file__).with_name("page.js")).read_text(encoding="utf-8") + "\n</script>"
EXTRA_CSS = """
#branch-rows, #branch-go, #list-go, #menu-download {display: none !important;}
.qc-tools {display: flex; gap: 4px; align-items: center; font-size: 0.85em; opacity: 0.9; padding: 0 8px;}
.qc-tools button {border: 1px solid var(--border-color-primary); border-radius: 4px; padding: 0 6px;
  background: var(--background-fill-secondary); color: var(--body-text-color); cursor: pointer;}
.qc-tools button:disabled {opacity: 0.4; cursor: default;}
.user-row .qc-tools {justify-content: flex-end;}
.qc-tools .qc-fork {opacity: 0.45;}
.message-row:hover .qc-tools .qc-fork, .qc-tools .qc-fork:focus {opacity: 1;}
@media (hover: none) {.qc-tools .qc-fork {opacity: 1;}}
@media (max-width: NARROW_MAX_PXpx) {
  .message-row:has(> .qc-tools) {flex-wrap: wrap;}
  .message-row > .qc-tools {flex-basis: 100%; padding: 2px 4px 0;}
}
#conv-list label {position: relative; padding-right: 2.2em;}
#conv-list label.selected {border-left: 3px solid var(--color-accent); background: var(--background-fill-secondary);
  font-weight: 600;}
#conv-list input[type=radio] {display: none;}
.qc-menu-btn {position: absolute; right: 4px; top: 50%; transform: translateY(-50%); border: none;
  background: transparent; color: var(--body-text-color); cursor: pointer; font-size: 1.1em; padding: 0 6px;}
.qc-menu-btn::before {content: "\\22EF";}
.qc-menu {position: fixed; z-index: 100000; min-width: 180px; background: var(--background-fill-primary);
  color: var(--body-text-color); border: 1px solid var(--border-color-primary); border-radius: 6px;
  box-shadow: 0 4px 16px rgba(0,0,0,0.25); padding: 4px; display: flex; flex-direction: column; gap: 2px;}
.qc-menu button {text-align: left; padding: 4px 8px; border: none; background: transparent;
  color: var(--body-text-color); cursor: pointer; border-radius: 4px;}
.qc-menu button:hover {background: var(--background-fill-secondary);}
.qc-menu .qc-danger {color: #dc2626;}
.qc-menu .qc-question {max-width: 240px; padding: 6px 8px; font-size: 0.9em; line-height: 1.35;}
.qc-menu .qc-actions {display: flex; justify-content: flex-end; gap: 6px; padding: 4px 8px 6px;}
.qc-menu .qc-actions button {text-align: center; padding: 4px 12px; font-weight: 600;}
.qc-menu .qc-actions .qc-cancel {border: 1px solid var(--border-color-primary);}
.qc-menu .qc-actions .qc-confirm {background: #dc2626; color: #fff;}
.qc-menu .qc-actions .qc-confirm:hover {background: #b91c1c;}
.qc-menu input, input.qc-rename {width: 100%; padding: 2px 6px; color: var(--body-text-color);
  background: var(--input-background-fill); border: 1px solid var(--border-color-primary); border-radius: 4px;}
""".replace("NARROW_MAX_PX", str(NARROW_PX - 1))


@dataclass
class Extras:
    """The components ``render_*`` add: the tag filter, the branch rows box and the two command buttons."""

    tag_filter: Any = None
    branch_rows: Any = None
    branch_go: Any = None
    list_go: Any = None
    menu_file: Any = None  # the zip the menu's Export prepared, saved by the browser at once (SAVE_JS)
    presets: Any = None  # presets_view.PresetControls


def render_tag_filter(x: Extras) -> None:
    """The tag filter above the conversation list (call inside the sidebar)."""
    x.tag_filter = gr.Dropdown(choices=[("All conversations", ALL_TAGS)], value=ALL_TAGS, show_label=False,
                               label="Filter conversations by tag",
                               elem_id="tag-filter", interactive=True, container=False)


def render_hidden(x: Extras) -> None:
    """The hidden channels of the page script (present in the page, never shown)."""
    x.branch_rows = gr.Textbox(value="[]", visible="hidden", elem_id="branch-rows")
    x.branch_go = gr.Button("branch", visible="hidden", elem_id="branch-go")
    x.list_go = gr.Button("list", visible="hidden", elem_id="list-go")
    x.menu_file = gr.File(visible="hidden", interactive=False, elem_id="menu-download")


COMMAND_JS = "(...args) => [window.qcPage ? window.qcPage.command : '', ...args.slice(1)]"
SAVE_JS = ("(f) => { if (f && f.url) { const a = document.createElement('a'); a.href = f.url; "
           "a.download = f.orig_name || ''; document.body.appendChild(a); a.click(); a.remove(); } return null; }")
ROWS_JS = "(rows) => { if (window.qcPage) window.qcPage.setRows(rows); return []; }"


def wire_extras(c: Any, x: Extras, ctl: Any, turns: Sequence[Any], user_of: Any) -> None:
    """Connect the extras of page ``c`` (``page_events.Page``); ``turns``: the events after which the open
    conversation's messages may have changed (the streaming turns, Stop); ``user_of(request)`` names the
    request's user."""
    private = dict(api_visibility="private", show_progress="hidden")
    branches, lists = BranchActions(ctl), ListActions(ctl)

    def rows(conv_id, request: gr.Request):
        return branch_json(ctl, user_of(request), conv_id)

    def listing(user: str, conv_id: Any, session: Any) -> dict:
        """The list (search text and tag of the tab applied) and the tag filter's choices."""
        session = session or Session()
        history = ctl.store.user(user)
        tags = tag_choices(history.list())
        if session.tag and session.tag not in [v for _, v in tags]:
            session.tag = ALL_TAGS
        items = ctl.conversation_choices(user, session.query, session.tag)
        value = conv_id if conv_id in {cid for _, cid in items} else None
        return {c.conv_list: gr.update(choices=items, value=value),
                x.tag_filter: gr.update(choices=tags, value=session.tag), c.session: session}

    def message_command(raw, conv_id, session, request: gr.Request):
        user = user_of(request)
        try:
            messages, cid, notice = branches.run(user, conv_id, raw)
        except ChatError as e:
            gr.Warning(html.escape(str(e)))
            return {c.notice: safe_markdown(str(e))}
        if session is not None and cid != conv_id:  # a fork: the tab moved to the new conversation
            session.move_to(cid)
        return {c.chatbot: messages, c.conv_id: cid, c.notice: safe_markdown(notice),
                x.branch_rows: branch_json(ctl, user, cid), **listing(user, cid, session)}

    def list_command(raw, conv_id, session, request: gr.Request):
        user = user_of(request)
        try:
            command = parse_command(raw)
            notice, path = lists.run(user, command)
        except ChatError as e:
            gr.Warning(html.escape(str(e)))
            return {c.notice: safe_markdown(str(e))}
        out = {c.notice: safe_markdown(notice), **listing(user, conv_id, session)}
        if path is not None:
            out[x.menu_file] = path
        if command["op"] == "delete" and command["conv"] == conv_id:  # the open chat is gone: a new chat
            out.update({c.chatbot: [], c.conv_id: "", x.branch_rows: "[]"})
            if session is not None:
                session.move_to("")
            out[c.conv_list] = listing(user, None, session)[c.conv_list]
        if command["op"] == "rename" and command["conv"] == conv_id:
            out[c.title_box] = ctl.title(user, conv_id)
        return out

    def filter_by_tag(tag, conv_id, session, request: gr.Request):
        session = session or Session()
        session.tag = tag if isinstance(tag, str) else ALL_TAGS
        return listing(user_of(request), conv_id, session)

    list_outputs = [c.conv_list, x.tag_filter, c.session]
    for event in turns:
        event.then(rows, [c.conv_id], [x.branch_rows], **private)
    c.conv_id.change(rows, [c.conv_id], [x.branch_rows], **private)
    x.branch_rows.change(None, [x.branch_rows], None, js=ROWS_JS, **private)
    def download(conv_id, request: gr.Request):
        """After a version switch or a rename: the Download button's zip holds what the page shows now."""
        return download_update(ctl, user_of(request), conv_id)

    x.branch_go.click(message_command, [x.branch_rows, c.conv_id, c.session],
                      [c.chatbot, c.conv_id, c.notice, x.branch_rows, *list_outputs], js=COMMAND_JS, **private).then(
        download, [c.conv_id], [c.download_btn], **private)
    x.list_go.click(list_command, [x.branch_rows, c.conv_id, c.session],
                    [c.notice, *list_outputs, x.menu_file, c.chatbot, c.conv_id, x.branch_rows, c.title_box],
                    js=COMMAND_JS, **private).then(None, [x.menu_file], [x.menu_file], js=SAVE_JS, **private).then(
        download, [c.conv_id], [c.download_btn], **private)
    x.tag_filter.input(filter_by_tag, [x.tag_filter, c.conv_id, c.session], list_outputs, **private)
    c.page.load(_tags_on_load(ctl, x, user_of), None, [x.tag_filter], **private)
    presets_view.wire(c, x.presets, ctl, user_of)


def _tags_on_load(ctl: Any, x: Extras, user_of: Any):
    def load(request: gr.Request):
        return gr.update(choices=tag_choices(ctl.store.user(user_of(request)).list()), value=ALL_TAGS)

    return load
