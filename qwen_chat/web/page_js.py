"""The page's own CSS and script (given to Gradio as ``css`` and ``head`` by ``server.build_app``).

``PAGE_CSS``: Gradio's own toasts hidden while the "service unavailable" banner is up (they repeat it as a red
"Error"), the statistics line under a reply, the phone layout (below ``NARROW_PX`` the title, model name and
demo banner shrink and the chat takes the height left, so Send / Stop and the last lines of a streaming reply
stay on a 390 x 844 screen), the message box's maximum height (it grows with its text up to ``MSG_MAX_VH`` % of
the window and scrolls after that), the "service unavailable" banner and the logged-in user's name.

``PAGE_HEAD``: one script that

* shows the edit box of a sent message as it was typed: the chat shows text made inert (``render.safe_markdown``
  writes ``<`` and ``&`` outside code as ``&lt;`` / ``&amp;``); when the Chatbot opens its edit box the script
  turns the text back (the same rule as ``render.plain_text``), so ``a < b && <b>`` reads as typed and is
  resent as typed;
* keyboard: **Esc** closes an open message edit unchanged, else presses Stop (while a reply streams), **Ctrl/Cmd+Shift+O** starts a new chat, **Up** in
  an empty message box opens the last message of yours for editing;
* asks ``/healthz`` every ``HEALTH_POLL_MS`` ms while a reply streams (Stop enabled) or the banner is up, and
  every ``HEALTH_IDLE_POLL_MS`` ms otherwise while the tab is on screen; when the service does not answer 200
  it shows "Service unavailable, reconnecting…", disables Stop and Send and says so in the message box, which
  stays open for typing (a streaming reply is saved as interrupted on the server); Gradio reloads the page
  once the service is back (what was typed is kept, below);
* drops KaTeX's "LaTeX-incompatible input" / "No character metrics" console warnings (one per formula per
  redraw of a streaming reply); a long display formula scrolls sideways inside the reply (CSS);
* keeps the message being typed in the tab's ``sessionStorage`` (every ``DRAFT_SAVE_MS`` ms, cleared when
  sent and at Log out) and puts it back into the empty box after a reload (Gradio reloads a tab after a
  restart);
* reloads the tab (at most once per ``LOGIN_RELOAD_GAP_MS``) when Gradio's API answers 401: a tab left open
  across a restart that turned login on, or whose login the restarted service no longer knows, shows the login
  page instead of "Error" badges.
"""
from __future__ import annotations

from qwen_chat.web.page_events import NARROW_PX
from qwen_chat.web.stats_view import STATS_CLASS

#: The message box grows with its text up to this share of the window height (%), then scrolls.  15: with the
#: chat's 420 px and the title and banner above it, Send / Stop stay on a 1280 x 900 screen with the box at its
#: tallest (bottom at 852 px; at 20 it was 898 px, and one more line of the banner, as other fonts wrap it, pushed
#: them off; at 30, to 963 px).
MSG_MAX_VH = 15
#: How often (ms) the page asks /healthz while a reply streams or the service is down.
HEALTH_POLL_MS = 2000
#: How often (ms) a tab without a streaming reply asks /healthz while it is on screen (a multiple of
#: ``HEALTH_POLL_MS``): an idle tab, too, says when the service is down.
HEALTH_IDLE_POLL_MS = 10_000
DOWN_TEXT = "Service unavailable, reconnecting…"
#: Least time (ms) between two reloads of a tab whose API calls got 401 (so a page that keeps getting 401 after
#: its reload cannot reload in a loop).
LOGIN_RELOAD_GAP_MS = 30_000
#: How often (ms) the message being typed is kept in the tab's sessionStorage (it survives a reload).
DRAFT_SAVE_MS = 1000

PAGE_CSS = f"""
#chatbot .message:has(.{STATS_CLASS}), #chatbot .bot:has(.{STATS_CLASS}) {{
  background: transparent !important; border: none !important; box-shadow: none !important;
  padding-top: 0 !important; padding-bottom: 0 !important; margin-top: -6px;}}
#chatbot .message-row:has(.{STATS_CLASS}) + .message-buttons {{display: none;}}
.{STATS_CLASS} {{font-size: 0.78em; opacity: 0.7; font-variant-numeric: tabular-nums;}}
#msg textarea {{max-height: {MSG_MAX_VH}vh !important; overflow-y: auto !important;}}
body:has(#service-banner) .toast-wrap {{display: none !important;}}
#service-banner {{background: #fee2e2; color: #7f1d1d; border-radius: 6px; padding: 4px 10px; font-weight: 600;}}
#user-name {{font-size: 0.9em; opacity: 0.85;}}
#chatbot .katex-display {{overflow-x: auto; overflow-y: hidden; max-width: 100%; padding: 2px 0;}}
@media (max-width: {NARROW_PX - 1}px) {{
  #page-title h2 {{font-size: 1.05em; margin: 0;}}
  #page-title p {{display: none;}}
  #demo-badge, #demo-badge p {{font-size: 0.72em !important; line-height: 1.25; padding: 1px 6px;}}
  #chatbot {{height: calc(100dvh - 400px) !important; min-height: 180px;}}
  #api-note {{display: none;}}
}}
"""

PAGE_JS = r"""
(() => {
  const unescapePlain = (t) => t
    .replace(/\]\\\(\s*<?\s*(?:javascript|vbscript|data|file):/gi, (m) => "](" + m.slice(3))
    .replace(/!\\\[/g, "![")
    .replace(/&(lt|amp);/g, (m, g) => (g === "lt" ? "<" : "&"));
  const plainInline = (line) => {
    let out = "", i = 0;
    while (i < line.length) {
      const start = line.indexOf("`", i);
      if (start < 0) { out += unescapePlain(line.slice(i)); break; }
      let run = 0;
      while (line[start + run] === "`") run++;
      const re = new RegExp("(?<!`)" + "`".repeat(run) + "(?!`)", "g");
      re.lastIndex = start + run;
      const close = re.exec(line);
      if (!close) { out += unescapePlain(line.slice(i, start + run)); i = start + run; continue; }
      out += unescapePlain(line.slice(i, start)) + line.slice(start, close.index + run);
      i = close.index + run;
    }
    return out;
  };
  const plainText = (shown) => {
    let fence = null;
    return shown.split("\n").map((line) => {
      const m = line.match(/^ {0,3}(`{3,}|~{3,})/);
      if (fence === null) {
        if (m) { fence = m[1]; return line; }
        return plainInline(line);
      }
      if (m && m[1][0] === fence[0] && m[1].length >= fence.length && !line.replace(/[ `~]/g, "")) fence = null;
      return line;
    }).join("\n");
  };
  window.qwenChatPlainText = plainText;
  const fixed = new WeakSet();
  const fixEditBoxes = () => {
    document.querySelectorAll("#chatbot textarea.edit-textarea").forEach((box) => {
      if (fixed.has(box)) return;
      fixed.add(box);
      const typed = plainText(box.value);
      if (typed !== box.value) {
        box.value = typed;
        box.dispatchEvent(new Event("input", { bubbles: true }));
      }
    });
  };
  new MutationObserver(() => setTimeout(fixEditBoxes, 0))
    .observe(document.documentElement, { childList: true, subtree: true });

  const lastEditButton = () => {
    // only the user's messages are editable: the last Edit button in the chat is the last message's
    const buttons = document.querySelectorAll("#chatbot button[aria-label=Edit]");
    return buttons.length ? buttons[buttons.length - 1] : null;
  };
  document.addEventListener("keydown", (e) => {
    const cancelEdit = document.querySelector("#chatbot button[aria-label=Cancel]");
    if (e.key === "Escape" && cancelEdit && document.querySelector("#chatbot textarea.edit-textarea")) {
      e.preventDefault();  // Esc leaves an open message edit unchanged
      cancelEdit.click();
      return;
    }
    const stop = document.querySelector("#stop");
    if (e.key === "Escape" && stop && !stop.disabled) {
      e.preventDefault();
      stop.click();
      return;
    }
    if ((e.ctrlKey || e.metaKey) && e.shiftKey && (e.key === "o" || e.key === "O")) {
      e.preventDefault();
      document.querySelector("#new-chat")?.click();
      return;
    }
    const box = e.target;
    if (e.key === "ArrowUp" && !e.shiftKey && !e.ctrlKey && !e.metaKey && !e.altKey
        && box instanceof HTMLTextAreaElement && box.closest("#msg") && box.value === "") {
      const edit = lastEditButton();
      if (edit) {
        e.preventDefault();
        edit.click();
        // the edit box appears on the next render: move the typing there, at the end of its text
        let tries = 0;
        const focusEdit = () => {
          const area = document.querySelector("#chatbot textarea.edit-textarea, #chatbot textarea");
          if (area) { area.focus(); area.setSelectionRange(area.value.length, area.value.length); }
          else if (++tries < 20) setTimeout(focusEdit, 50);
        };
        setTimeout(focusEdit, 0);
      }
    }
  }, true);

  // The message being typed survives a reload of the tab (Gradio reloads a tab after the service restarted):
  // kept in the tab's sessionStorage every second, cleared when it is sent, put back into an empty box.
  const DRAFT = "qc-draft";
  let restored = false;
  setInterval(() => {
    const box = document.querySelector("#msg textarea");
    if (!box || leaving) return;
    if (!restored) {
      restored = true;
      const draft = sessionStorage.getItem(DRAFT) || "";
      if (draft && !box.value) {
        box.value = draft;
        box.dispatchEvent(new Event("input", { bubbles: true }));
        return;
      }
    }
    sessionStorage.setItem(DRAFT, box.value);
  }, __DRAFT_MS__);
  const sent = () => sessionStorage.setItem(DRAFT, "");
  let leaving = false;
  document.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && e.target instanceof HTMLTextAreaElement && e.target.closest("#msg")) sent();
  }, true);
  document.addEventListener("click", (e) => {
    if (!e.target.closest) return;
    if (e.target.closest("#send")) sent();
    if (e.target.closest("#logout")) {  // the next user of this tab starts with an empty box
      leaving = true;
      sessionStorage.removeItem(DRAFT);
    }
  }, true);

  // KaTeX warns on the console for every formula with characters outside LaTeX (a model's Unicode in math),
  // again at each redraw of a streaming reply: those lines are dropped, every other warning is kept.
  const plainWarn = console.warn.bind(console);
  console.warn = (...args) => {
    const first = String(args[0] || "");
    if (first.startsWith("LaTeX-incompatible input") || first.startsWith("No character metrics")) return;
    plainWarn(...args);
  };

  // A tab opened before a restart that turned login on (or with a login the restarted service no longer
  // knows) gets 401 from Gradio's API: reload it once, so the login page shows instead of "Error" badges.
  const plainFetch = window.fetch.bind(window);
  window.fetch = async (...args) => {
    const answer = await plainFetch(...args);
    const url = String(args[0] && args[0].url ? args[0].url : args[0]);
    if (answer.status === 401 && url.includes("/gradio_api/")) {
      const last = Number(sessionStorage.getItem("qc-login-reload") || 0);
      if (Date.now() - last > __RELOAD_GAP_MS__) {
        sessionStorage.setItem("qc-login-reload", String(Date.now()));
        window.location.reload();
      }
    }
    return answer;
  };

  let down = false;
  const showDown = (on) => {
    down = on;
    let banner = document.getElementById("service-banner");
    const chat = document.getElementById("chatbot");
    if (on && !banner && chat) {
      banner = document.createElement("div");
      banner.id = "service-banner";
      banner.setAttribute("role", "status");
      banner.textContent = "__DOWN_TEXT__";
      chat.parentElement.insertBefore(banner, chat);
    } else if (!on && banner) {
      banner.remove();
    }
    const stop = document.querySelector("#stop");
    if (on && stop) stop.disabled = true;
    const send = document.querySelector("#send");
    if (send) {
      if (on) { send.dataset.qcWasDisabled = String(send.disabled); send.disabled = true; }
      else if (send.dataset.qcWasDisabled !== undefined) {
        send.disabled = send.dataset.qcWasDisabled === "true";
        delete send.dataset.qcWasDisabled;
      }
    }
    const msg = document.querySelector("#msg textarea");
    if (on && msg) {
      msg.placeholder = "__DOWN_TEXT__";
      msg.disabled = false;  // typing goes on (kept in the tab for the reload); only sending waits
    }
  };
  let idleTicks = 0;
  setInterval(async () => {
    const stop = document.querySelector("#stop");
    const streaming = !!stop && !stop.disabled;
    if (!down && !streaming) {  // an idle tab asks less often, and only while it is on screen
      idleTicks = (idleTicks + 1) % __IDLE_EVERY__;
      if (idleTicks !== 0 || document.visibilityState !== "visible") return;
    }
    let ok = false;
    try {
      const answer = await fetch("healthz", { cache: "no-store" });
      ok = answer.ok;
    } catch (err) { ok = false; }
    if (ok !== !down) showDown(!ok);
  }, __POLL_MS__);
})();
"""

_FILLED = {"__DOWN_TEXT__": DOWN_TEXT, "__POLL_MS__": str(HEALTH_POLL_MS),
           "__RELOAD_GAP_MS__": str(LOGIN_RELOAD_GAP_MS), "__DRAFT_MS__": str(DRAFT_SAVE_MS),
           "__IDLE_EVERY__": str(HEALTH_IDLE_POLL_MS // HEALTH_POLL_MS)}
_script = PAGE_JS
for _mark, _value in _FILLED.items():
    _script = _script.replace(_mark, _value)
PAGE_HEAD = "<script>" + _script + "</script>"
