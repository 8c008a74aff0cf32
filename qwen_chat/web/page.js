// The chat page's own script (qwen_chat/web/page_extras.py puts it in the page's head).
// 1. Under each message of the open conversation: "< 2/3 >" where Edit or Regenerate kept earlier versions, and
//    "Fork" (a new conversation with the turns up to that message).  What to draw comes from the server as JSON
//    (#branch-rows: [{row, id, role, shown, count}], row = position in the Chatbot); hidden while a reply streams.
// 2. A menu button on every entry of the conversation list: Rename (inline), Pin / Unpin, Tags (the list's
//    filter), Export, Delete (after a confirmation).
// A command is JSON in window.qcPage.command, sent by clicking the hidden #branch-go / #list-go button.
(() => {
  const Q = (window.qcPage = window.qcPage || {});
  const PIN = "\u2605 ";  // sidebar.PIN_MARK
  const TAG = " \u00b7 tags: ";  // sidebar.TAG_MARK
  const RUNNING = " \u00b7 writing\u2026";  // sidebar.RUNNING_MARK (a reply still being written)
  Q.rows = [];
  Q.command = "";

  Q.send = (button, command) => {
    Q.command = JSON.stringify(command);
    const target = document.querySelector("#" + button);
    if (target) target.click();
  };

  Q.setRows = (json) => {
    try {
      Q.rows = JSON.parse(json || "[]");
    } catch (e) {
      Q.rows = [];
    }
    schedule();
  };

  const busy = () => {
    const stop = document.querySelector("#stop");
    return !!stop && !stop.disabled;
  };

  const button = (text, label, onClick, disabled) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = text;
    b.setAttribute("aria-label", label);
    b.title = label;
    b.disabled = !!disabled;
    b.addEventListener("click", (ev) => {
      ev.preventDefault();
      ev.stopPropagation();
      onClick(ev);
    });
    return b;
  };

  // What the bars were last drawn for: nothing is redrawn while that holds and every bar is still in place
  // (typing in a long conversation costs no redraw).
  let drawn = "";
  function drawTools() {
    const chat = document.querySelector("#chatbot");
    if (!chat) return;
    const rows = chat.querySelectorAll(".message-wrap > .message-row");
    const idle = !busy();
    const wanted = idle ? Q.rows.filter((item) => rows[item.row]).length : 0;
    const key = `${idle}|${rows.length}|${JSON.stringify(Q.rows)}`;
    const bars = chat.querySelectorAll(".qc-tools");
    if (key === drawn && bars.length === wanted &&
        [...bars].every((bar) => bar.parentElement && bar.parentElement.classList.contains("message-row"))) return;
    drawn = key;
    bars.forEach((e) => e.remove());
    if (!idle) return;
    for (const item of Q.rows) {
      const row = rows[item.row];
      if (!row) continue;
      const bar = document.createElement("div");
      bar.className = "qc-tools";
      bar.dataset.messageId = item.id;
      if (item.count > 1) {
        bar.appendChild(button("\u2039", "Previous version", () =>
          Q.send("branch-go", { op: "switch", msg: item.id, step: -1 }), item.shown <= 1));
        const where = document.createElement("span");
        where.className = "qc-version";
        where.textContent = `${item.shown}/${item.count}`;
        bar.appendChild(where);
        bar.appendChild(button("\u203a", "Next version", () =>
          Q.send("branch-go", { op: "switch", msg: item.id, step: 1 }), item.shown >= item.count));
      }
      const fork = button("Fork", "Fork: a new chat with the turns up to here", () =>
        Q.send("branch-go", { op: "fork", msg: item.id }));
      fork.classList.add("qc-fork");
      bar.appendChild(fork);
      row.appendChild(bar);
    }
  }

  // --- the conversation list's menu
  function entryOf(label) {
    const input = label.querySelector("input[type=radio]");
    const span = label.querySelector("span");
    const text = span ? span.textContent : "";
    const pinned = text.startsWith(PIN);
    let rest = pinned ? text.slice(PIN.length) : text;
    let tags = "";
    const at = rest.lastIndexOf(TAG);
    if (at >= 0) {
      tags = rest.slice(at + TAG.length);
      rest = rest.slice(0, at);
    }
    if (rest.endsWith(RUNNING)) rest = rest.slice(0, rest.length - RUNNING.length);
    const dot = rest.lastIndexOf(" \u00b7 ");
    const title = dot >= 0 ? rest.slice(0, dot) : rest;
    return { id: input ? input.value : "", pinned, tags, title, span };
  }

  function closeMenu() {
    document.querySelectorAll(".qc-menu").forEach((m) => m.remove());
  }

  function inlineRename(label, entry) {
    closeMenu();
    if (!entry.span) return;
    const box = document.createElement("input");
    box.className = "qc-rename";
    box.value = entry.title;
    box.setAttribute("aria-label", "New title");
    entry.span.style.display = "none";
    label.insertBefore(box, entry.span);
    let done = false;
    const finish = (save) => {
      if (done) return;
      done = true;
      const title = box.value.trim();
      box.remove();
      entry.span.style.display = "";
      if (save && title && title !== entry.title) Q.send("list-go", { op: "rename", conv: entry.id, title });
    };
    box.addEventListener("keydown", (ev) => {
      ev.stopPropagation();
      if (ev.key === "Enter") { ev.preventDefault(); finish(true); }
      if (ev.key === "Escape") { ev.preventDefault(); finish(false); }
    });
    box.addEventListener("click", (ev) => { ev.preventDefault(); ev.stopPropagation(); });
    box.addEventListener("blur", () => finish(false));
    box.focus();
    box.select();
  }

  function openMenu(label, anchor) {
    closeMenu();
    const entry = entryOf(label);
    const menu = document.createElement("div");
    menu.className = "qc-menu";
    menu.setAttribute("role", "menu");
    menu.dataset.conv = entry.id;
    const item = (text, onClick, cls) => {
      const b = button(text, text, onClick);
      b.setAttribute("role", "menuitem");
      if (cls) b.className = cls;
      menu.appendChild(b);
      return b;
    };
    item("Rename", () => inlineRename(label, entry));
    item(entry.pinned ? "Unpin" : "Pin", () => {
      closeMenu();
      Q.send("list-go", { op: "pin", conv: entry.id, pinned: !entry.pinned });
    });
    item("Tags\u2026", () => {
      menu.replaceChildren();
      const box = document.createElement("input");
      box.className = "qc-tags";
      box.value = entry.tags;
      box.placeholder = "tags, comma separated";
      box.setAttribute("aria-label", "Tags, comma separated");
      box.addEventListener("keydown", (ev) => {
        ev.stopPropagation();
        if (ev.key === "Enter") {
          ev.preventDefault();
          closeMenu();
          Q.send("list-go", { op: "tags", conv: entry.id, tags: box.value });
        }
        if (ev.key === "Escape") closeMenu();
      });
      menu.appendChild(box);
      box.focus();
    });
    item("Export", () => { closeMenu(); Q.send("list-go", { op: "export", conv: entry.id }); });
    item("Delete\u2026", () => {
      menu.replaceChildren();
      const question = document.createElement("div");
      question.className = "qc-question";
      question.textContent = `Delete \u201c${entry.title}\u201d and its images? This cannot be undone.`;
      menu.appendChild(question);
      const actions = document.createElement("div");
      actions.className = "qc-actions";
      actions.append(item("Cancel", closeMenu, "qc-cancel"), item("Delete", () => {
        closeMenu();
        Q.send("list-go", { op: "delete", conv: entry.id });
      }, "qc-confirm"));
      menu.appendChild(actions);
      menu.setAttribute("aria-label", "Delete conversation?");
      place(menu, anchor);
      actions.querySelector(".qc-cancel").focus();
    }, "qc-danger");
    document.body.appendChild(menu);
    place(menu, anchor);
  }

  // Put the menu under its button, inside the window (again after its content changed size).
  function place(menu, anchor) {
    const r = anchor.getBoundingClientRect();
    menu.style.top = `${Math.max(4, Math.min(r.bottom + 2, window.innerHeight - menu.offsetHeight - 4))}px`;
    const left = Math.min(r.right - menu.offsetWidth, window.innerWidth - menu.offsetWidth - 4);
    menu.style.left = `${Math.max(4, left)}px`;
  }

  function drawMenus() {
    document.querySelectorAll("#conv-list label").forEach((label) => {
      if (label.querySelector(".qc-menu-btn")) return;
      // the glyph comes from CSS (::before), so the entry's text stays its label
      const b = button("", "Conversation menu", (ev) => openMenu(label, ev.currentTarget));
      b.className = "qc-menu-btn";
      label.appendChild(b);
    });
  }

  document.addEventListener("click", (ev) => {
    if (!ev.target.closest || ev.target.closest(".qc-menu") || ev.target.closest(".qc-menu-btn")) return;
    closeMenu();
  });
  document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") closeMenu(); });

  // --- redraw after Gradio re-renders (our own nodes do not count)
  let pending = false;
  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      drawTools();
      drawMenus();
    });
  }
  const ours = (node) => node.nodeType === 1 && node.classList &&
    (node.classList.contains("qc-tools") || node.classList.contains("qc-menu-btn") ||
     node.classList.contains("qc-menu") || node.classList.contains("qc-rename"));
  const observer = new MutationObserver((records) => {
    for (const r of records) {
      if (r.type === "attributes") { if (!ours(r.target)) { schedule(); return; } continue; }
      const nodes = [...r.addedNodes, ...r.removedNodes];
      if (nodes.length === 0 || !nodes.every(ours)) {
        if (r.target.closest && r.target.closest(".qc-tools, .qc-menu")) continue;
        schedule();
        return;
      }
    }
  });
  const start = () => observer.observe(document.body, { childList: true, subtree: true, attributes: true,
    attributeFilter: ["disabled"] });
  if (document.body) start(); else document.addEventListener("DOMContentLoaded", start);
})();
