// The chat page: plain DOM, no framework, no network but this server.
// Model output is untrusted: it reaches the page only as text nodes, never parsed as HTML.
"use strict";

const STORE = "turbospark.chat.v1";
const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), newChat: $("new-chat"), list: $("conversations"), system: $("system"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), keyForm: $("key-form"), apiKey: $("api-key"),
  messages: $("messages"), status: $("status"), composer: $("composer"), prompt: $("prompt"),
  send: $("send"), stop: $("stop"),
};
let state = loadState();
let apiKey = sessionStorage.getItem(STORE + ".key") || "";
let running = null;   // {controller, conversation} while a reply streams

// ---- storage ----

function loadState() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "null");
    if (saved && Array.isArray(saved.conversations)) return saved;
  } catch (e) { /* a damaged store starts over */ }
  return { conversations: [], current: null };
}

function save() {
  try { localStorage.setItem(STORE, JSON.stringify(state)); } catch (e) { setStatus("Could not save: " + e.message); }
}

function current() {
  let conv = state.conversations.find((c) => c.id === state.current);
  if (!conv) {
    conv = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
    state.conversations.unshift(conv);
    state.current = conv.id;
  }
  return conv;
}

// ---- server ----

async function api(path, init = {}) {
  const headers = Object.assign({}, init.headers);
  if (apiKey) headers.Authorization = "Bearer " + apiKey;
  const resp = await fetch(path, Object.assign({}, init, { headers }));
  if (resp.status === 401) {
    ui.keyForm.hidden = false;
    ui.apiKey.focus();
    throw new Error(apiKey ? "The API key was refused." : "This server needs an API key.");
  }
  if (!resp.ok) {
    let message = resp.status + " " + resp.statusText;
    try {
      const body = await resp.json();
      message = (body.error && body.error.message) || message;
    } catch (e) { /* not JSON: keep the status line */ }
    throw new Error(message);
  }
  return resp;
}

async function loadModels() {
  try {
    const body = await (await api("/v1/models")).json();
    // The last choice if still offered, else a model already loaded (no wait for a load).
    const ids = body.data.map((m) => m.id);
    const loaded = body.data.find((m) => m.loaded);
    const chosen = [ui.model.value, localStorage.getItem(STORE + ".model"), loaded && loaded.id]
      .find((id) => ids.includes(id));
    ui.model.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (chosen) ui.model.value = chosen;
    setStatus("");
  } catch (e) {
    setStatus(e.message);
  }
}

// Reads an SSE body, calling onData with each parsed `data:` payload until [DONE].
async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  const conv = current();
  if (conv.messages.length === 0) conv.title = text.slice(0, 40);
  conv.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "", model: ui.model.value };
  conv.messages.push(reply);
  save();
  render();
  const history = conv.messages.filter((m) => m !== reply && !m.error)
    .map((m) => ({ role: m.role, content: m.content }));
  if (ui.system.value.trim()) history.unshift({ role: "system", content: ui.system.value });
  const body = { model: ui.model.value, messages: history, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat(ui.temperature.value);
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const controller = new AbortController();
  running = { controller, conversation: conv };
  setRunning(true);
  const node = ui.messages.lastElementChild;
  let first = null;
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);   // a mid-stream `event: error`
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if (delta.content || delta.reasoning_content) first = first || performance.now();
      if (delta.content) reply.content += delta.content;
      if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
      if (chunk.usage) reply.stats = stats(chunk.usage, first);
      fillMessage(node, reply);
      scrollDown();
    });
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else reply.error = e.message;
  } finally {
    running = null;
    setRunning(false);
    save();
    fillMessage(node, reply);
  }
}

function stats(usage, first) {
  const seconds = first ? (performance.now() - first) / 1000 : 0;
  const rate = seconds > 0 && usage.completion_tokens > 1 ? (usage.completion_tokens - 1) / seconds : null;
  return usage.prompt_tokens + " prompt + " + usage.completion_tokens + " completion tokens" +
    (rate ? ", " + rate.toFixed(1) + " tokens/s" : "");
}

// ---- rendering ----

function render() {
  renderList();
  const conv = state.conversations.find((c) => c.id === state.current);
  const messages = conv ? conv.messages : [];
  ui.messages.replaceChildren(...messages.map((m) => fillMessage(document.createElement("article"), m)));
  scrollDown();
}

function renderList() {
  ui.list.replaceChildren(...state.conversations.map((conv) => {
    const li = el("li", conv.id === state.current ? "current" : "");
    const open = el("button", "open", conv.title || "New chat");
    open.type = "button";
    open.addEventListener("click", () => { if (!running) { state.current = conv.id; save(); render(); } });
    const del = el("button", "delete", "×");
    del.type = "button";
    del.setAttribute("aria-label", "Delete chat " + (conv.title || ""));
    del.addEventListener("click", () => removeConversation(conv));
    li.append(open, del);
    return li;
  }));
}

function fillMessage(node, msg) {
  node.className = "msg " + msg.role + (msg.error ? " error" : "");
  const parts = [el("div", "role", msg.role === "user" ? "You" : (msg.model || "Assistant"))];
  if (msg.reasoning) {
    const details = el("details", "reasoning");
    details.append(el("summary", "", "Reasoning"), ...markdown(msg.reasoning));
    parts.push(details);
  }
  parts.push(...markdown(msg.content));
  if (msg.error) parts.push(el("p", "error-text", msg.error));
  const notes = [msg.stats, msg.stopped ? "stopped" : ""].filter(Boolean).join(" · ");
  if (notes) parts.push(el("div", "stats", notes));
  node.replaceChildren(...parts);
  return node;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// A small Markdown subset (paragraphs, headings, lists, fenced code, inline code, bold, italics)
// built as DOM nodes, so markup in the text stays text.
function markdown(text) {
  const out = [];
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```(.*)$/);
    if (fence) {
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      i++;
      out.push(codeBlock(code.join("\n"), fence[1].trim()));
    } else if (/^\s*$/.test(line)) {
      i++;
    } else if (/^#{1,6}\s/.test(line)) {
      const level = line.match(/^#+/)[0].length;
      out.push(inline(el("h" + Math.min(level + 2, 6)), line.replace(/^#+\s*/, "")));
      i++;
    } else if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
      const ordered = /^\s*\d/.test(line);
      const list = el(ordered ? "ol" : "ul");
      for (; i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i]); i++) {
        list.append(inline(el("li"), lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, "")));
      }
      out.push(list);
    } else {
      const para = [];
      for (; i < lines.length && !/^\s*$/.test(lines[i]) && !/^\s*```/.test(lines[i]) &&
             !/^\s*([-*+]|\d+[.)])\s+/.test(lines[i]) && !/^#{1,6}\s/.test(lines[i]); i++) para.push(lines[i]);
      out.push(inline(el("p"), para.join("\n")));
    }
  }
  return out;
}

function codeBlock(code, lang) {
  const pre = el("pre");
  const codeNode = el("code", "", code);
  if (lang) codeNode.dataset.lang = lang;
  const copy = el("button", "copy", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy code");
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code);
      copy.textContent = "Copied";
    } catch (e) {
      copy.textContent = "Copy failed";     // no clipboard outside a secure context
    }
  });
  pre.append(copy, codeNode);
  return pre;
}

function inline(parent, text) {
  const pattern = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
  let last = 0;
  for (const m of text.matchAll(pattern)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    const token = m[0];
    if (token.startsWith("`")) parent.append(el("code", "", token.slice(1, -1)));
    else if (token.startsWith("**")) parent.append(el("strong", "", token.slice(2, -2)));
    else parent.append(el("em", "", token.slice(1, -1)));
    last = m.index + token.length;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  return parent;
}

// ---- actions ----

function setRunning(on) {
  ui.send.disabled = on;
  ui.stop.disabled = !on;
  ui.newChat.disabled = on;
  setStatus(on ? "Generating…" : "");
}

function setStatus(text) { ui.status.textContent = text; }

function scrollDown() { ui.messages.scrollTop = ui.messages.scrollHeight; }

function removeConversation(conv) {
  if (running && running.conversation === conv) running.controller.abort();
  state.conversations = state.conversations.filter((c) => c !== conv);
  if (state.current === conv.id) state.current = state.conversations.length ? state.conversations[0].id : null;
  save();
  render();
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || running || !ui.model.value) return;
  ui.prompt.value = "";
  send(text);
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});
ui.stop.addEventListener("click", () => { if (running) running.controller.abort(); });
ui.newChat.addEventListener("click", () => { state.current = null; current(); save(); render(); ui.prompt.focus(); });
ui.model.addEventListener("change", () => localStorage.setItem(STORE + ".model", ui.model.value));
ui.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = ui.apiKey.value.trim();
  sessionStorage.setItem(STORE + ".key", apiKey);
  ui.keyForm.hidden = true;
  loadModels();
});

render();
loadModels();
