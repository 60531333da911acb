// The tokenwire chat UI. Everything the model says is rendered by markdown.js as DOM nodes (never
// innerHTML); every file comes from the gateway itself (no CDN).
//
// The conversation lives in the page (and localStorage, so a reload keeps it): each turn sends the whole
// conversation in messages mode. A reply that was streaming when the page was reloaded is resumed by
// its request id. `?ws=ws://host:port/v1/ws` points the UI at another server.
import { TokenwireClient } from "../src/browser.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"),
  statusText: $("status-text"),
  conversation: $("conversation"),
  form: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  temperature: $("temperature"),
  maxTokens: $("max-tokens"),
  seed: $("seed"),
  cache: $("cache"),
};

const STORE = "tokenwire:ui:";
const STATE_TEXT = {
  idle: "Not connected",
  connecting: "Connecting…",
  open: "Connected",
  reconnecting: "Reconnecting…",
  closed: "Disconnected",
};

const params = new URLSearchParams(location.search);
const wsUrl = params.get("ws") || new URL("v1/ws", location.href).href.replace(/^http/, "ws");
const client = new TokenwireClient(wsUrl);

/** @type {{role: string, content: string, id?: string, status?: string, note?: string, el?: HTMLElement}[]} */
let turns = [];
let current = null; // the assistant turn that is streaming

// ---------------------------------------------------------------------------------------- connection

client.on("state", ({ state, delay }) => {
  ui.status.dataset.state = state;
  ui.statusText.textContent = state === "reconnecting" && delay != null ? `Reconnecting… (${(delay / 1000).toFixed(1)} s)` : STATE_TEXT[state] ?? state;
  ui.status.title = client.welcome ? `server ${client.welcome.server}` : "";
});

// ---------------------------------------------------------------------------------------- settings

function loadSettings() {
  try {
    const s = JSON.parse(localStorage.getItem(`${STORE}settings`) || "{}");
    if (Number.isFinite(s.temperature)) ui.temperature.value = s.temperature;
    if (Number.isInteger(s.maxTokens)) ui.maxTokens.value = s.maxTokens;
    if (typeof s.seed === "string") ui.seed.value = s.seed;
    if (typeof s.cache === "boolean") ui.cache.checked = s.cache;
  } catch {
    // defaults from the HTML
  }
}

const MAX_SEED = 2n ** 63n - 1n;

/** The sampling parameters of the settings panel (a seed only when one is given: same seed, same reply). */
function settings() {
  const t = Math.min(2, Math.max(0, Number(ui.temperature.value)));
  const m = Math.min(8192, Math.max(1, Math.round(Number(ui.maxTokens.value))));
  const p = { temperature: Number.isFinite(t) ? t : 0.7, max_tokens: Number.isFinite(m) ? m : 256 };
  const seed = ui.seed.value.trim();
  if (/^\d{1,19}$/.test(seed) && BigInt(seed) <= MAX_SEED) p.seed = BigInt(seed);
  if (!ui.cache.checked) p.cache = false;
  return p;
}

for (const input of [ui.temperature, ui.maxTokens, ui.seed, ui.cache]) {
  input.addEventListener("change", () => {
    const s = settings();
    const saved = { temperature: s.temperature, maxTokens: s.max_tokens, seed: ui.seed.value.trim(), cache: ui.cache.checked };
    localStorage.setItem(`${STORE}settings`, JSON.stringify(saved));
  });
}

// ---------------------------------------------------------------------------------------- conversation

function save() {
  const plain = turns.map(({ role, content, id, status, note }) => ({ role, content, id, status, note }));
  try {
    localStorage.setItem(`${STORE}conversation`, JSON.stringify(plain));
  } catch {
    // storage full or disabled: the page still works
  }
}

function addTurn(turn) {
  const el = document.createElement("article");
  el.className = `turn ${turn.role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = turn.role === "user" ? "You" : "Model";
  const content = document.createElement("div");
  content.className = "content";
  const note = document.createElement("div");
  note.className = "note";
  el.append(who, content, note);
  ui.conversation.appendChild(el);
  turn.el = el;
  turns.push(turn);
  paint(turn);
  return turn;
}

function paint(turn) {
  const el = turn.el;
  el.dataset.status = turn.status ?? "done";
  if (turn.id) el.dataset.requestId = turn.id;
  const content = el.querySelector(".content");
  if (turn.role === "user") content.textContent = turn.content;
  else content.replaceChildren(renderMarkdown(turn.content));
  el.querySelector(".note").textContent = turn.note ?? "";
}

let paintScheduled = null;
function schedulePaint(turn) {
  if (paintScheduled) return;
  paintScheduled = requestAnimationFrame(() => {
    paintScheduled = null;
    const stick = nearBottom();
    paint(turn);
    if (stick) scrollToEnd();
  });
}

function nearBottom() {
  const s = document.scrollingElement;
  return s.scrollHeight - s.scrollTop - s.clientHeight < 80;
}

function scrollToEnd() {
  document.scrollingElement.scrollTop = document.scrollingElement.scrollHeight;
}

function setBusy(busy) {
  ui.stop.hidden = !busy;
  ui.send.disabled = busy;
  document.body.classList.toggle("busy", busy);
}

async function stream(turn, chatStream) {
  current = turn;
  turn.id = chatStream.id;
  turn.status = "streaming";
  turn.note = "";
  paint(turn);
  save();
  setBusy(true);
  try {
    for await (const item of chatStream) {
      if (item.type === "reset") turn.content = "";
      else turn.content += item.text;
      schedulePaint(turn);
    }
    const result = await chatStream.result;
    turn.status = result.finishReason === "cancelled" ? "cancelled" : "done";
    turn.note = result.finishReason === "cancelled" ? "stopped" : result.finishReason === "length" ? "max tokens reached" : "";
  } catch (err) {
    turn.status = "error";
    turn.note = `error: ${err.code ?? ""} ${err.message ?? err}`.trim();
  } finally {
    if (paintScheduled) cancelAnimationFrame(paintScheduled);
    paintScheduled = null;
    paint(turn);
    save();
    if (current === turn) current = null;
    setBusy(false);
    ui.prompt.focus();
  }
}

function ask(text) {
  // The conversation so far (stopped replies included, as far as they got), then the new question.
  const messages = turns
    .filter((t) => t.content && t.status !== "error")
    .map((t) => ({ role: t.role, content: t.content }));
  messages.push({ role: "user", content: text });
  addTurn({ role: "user", content: text, status: "done" });
  const reply = addTurn({ role: "assistant", content: "", status: "streaming" });
  scrollToEnd();
  return stream(reply, client.chat(messages, settings()));
}

ui.form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || current) return;
  ui.prompt.value = "";
  ask(text);
});

ui.prompt.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    ui.form.requestSubmit();
  }
});

ui.stop.addEventListener("click", () => {
  if (current?.id) client.cancel(current.id);
});

ui.newChat.addEventListener("click", () => {
  if (current?.id) client.cancel(current.id);
  turns = [];
  current = null;
  ui.conversation.replaceChildren();
  save();
  setBusy(false);
  ui.prompt.focus();
});

// ---------------------------------------------------------------------------------------- start

function restore() {
  let saved = [];
  try {
    saved = JSON.parse(localStorage.getItem(`${STORE}conversation`) || "[]");
  } catch {
    saved = [];
  }
  for (const t of Array.isArray(saved) ? saved : []) {
    if (t && (t.role === "user" || t.role === "assistant") && typeof t.content === "string") addTurn({ ...t });
  }
  const last = turns[turns.length - 1];
  if (last && last.role === "assistant" && last.status === "streaming" && last.id) {
    // The page was reloaded mid-reply: replay that request from its start and follow it live.
    last.content = "";
    stream(last, client.resume(last.id));
  }
  scrollToEnd();
}

loadSettings();
restore();
ui.prompt.focus();

// For debugging from the console (and the browser tests): the client and the conversation.
globalThis.tokenwireUI = {
  client,
  get turns() {
    return turns.map(({ role, content, id, status, note }) => ({ role, content, id, status, note }));
  },
};
