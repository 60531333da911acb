// The tokenwire chat UI. Everything the model says is rendered by markdown.js as DOM nodes (never
// innerHTML); every file comes from the gateway itself (no CDN).
//
// The conversation lives in the page (and localStorage, so a reload keeps it): each turn sends the whole
// conversation in messages mode. A reply that was streaming when the page was reloaded (or its tab
// closed) is followed again: its chat is sent again with the same id (the server attaches to it, or
// starts it if it never got it). Tabs of this page share the conversation (the `storage` event).
//
// A reply that makes no progress says why, in the reply and in the header, instead of a plain
// "Connected": queued behind a model that is still loading (welcome.loading), queued, or waiting for the
// server to resume it after a reconnect (a restarted server continues it once the lost worker's lease
// lapses). It goes the moment tokens flow again.
//
// The browser's `offline` event drops the connection at once (the page stops saying "Connected" while
// the heartbeat would still be waiting for its ping), and `online` reconnects at once instead of waiting
// out the backoff; the banner counts the seconds to the next attempt down.
//
// Which server: the one this page came from. `?ws=wss://host/v1/ws` may name another, but only one the
// server lists in its /config.json (`tokenwire serve --ui-connect ORIGIN`); anything else is refused with
// a visible message and nothing is sent (the page keeps a whole conversation that a crafted link must not
// be able to ship elsewhere; the page's Content-Security-Policy enforces the same list).
import { TokenwireClient } from "../src/browser.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"),
  statusText: $("status-text"),
  banner: $("banner"),
  conversation: $("conversation"),
  empty: $("empty"),
  modelName: $("model-name"),
  model: $("model"),
  form: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  settingsToggle: $("settings-toggle"),
  settingsPanel: $("settings-panel"),
  defaultsNote: $("defaults-note"),
  resetSettings: $("reset-settings"),
  temperature: $("temperature"),
  topP: $("top-p"),
  maxTokens: $("max-tokens"),
  repetitionPenalty: $("repetition-penalty"),
  frequencyPenalty: $("frequency-penalty"),
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
  refused: "Not connected",
};
// Used only when the server's /config.json cannot be read (an old server): the server's own defaults.
const FALLBACK_DEFAULTS = { temperature: 0, top_p: 0.9, max_tokens: 256, repetition_penalty: 1, frequency_penalty: 0.3 };
// Settings fields: input element, params key, parse.
const FIELDS = [
  { el: ui.temperature, key: "temperature", min: 0, max: 2 },
  { el: ui.topP, key: "top_p", min: 0.01, max: 1 },
  { el: ui.maxTokens, key: "max_tokens", min: 1, max: 8192, integer: true },
  { el: ui.repetitionPenalty, key: "repetition_penalty", min: 0.5, max: 2 },
  { el: ui.frequencyPenalty, key: "frequency_penalty", min: -2, max: 2 },
];

/** The server's config: sampling defaults, model name, the extra WebSocket origins it allows. */
async function loadConfig() {
  try {
    const r = await fetch(new URL("config.json", location.href), { cache: "no-cache" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const c = await r.json();
    return {
      defaults: { ...FALLBACK_DEFAULTS, ...(c.defaults ?? {}) },
      connect: Array.isArray(c.connect) ? c.connect.filter((o) => typeof o === "string") : [],
      model: typeof c.model === "string" ? c.model : null,
      models: Array.isArray(c.models) ? c.models.filter((m) => typeof m === "string") : [],
      maxTokens: Number.isInteger(c.limits?.max_tokens) ? c.limits.max_tokens : 8192,
    };
  } catch {
    return { defaults: { ...FALLBACK_DEFAULTS }, connect: [], model: null, models: [], maxTokens: 8192 };
  }
}

/** The WebSocket URL to use: this page's server, or a `?ws=` one the server lists; else `refused`. */
function pickServer(config) {
  const own = new URL("v1/ws", location.href).href.replace(/^http/, "ws");
  const asked = new URLSearchParams(location.search).get("ws");
  if (!asked) return { url: own };
  let u;
  try {
    u = new URL(asked);
  } catch {
    return { refused: asked };
  }
  if (u.protocol !== "ws:" && u.protocol !== "wss:") return { refused: asked };
  const origin = `${u.protocol}//${u.host}`;
  if (u.host === location.host || config.connect.includes(origin)) return { url: u.href };
  return { refused: origin };
}

const config = await loadConfig();
const server = pickServer(config);
const client = server.url ? new TokenwireClient(server.url) : null;
const host = server.url ? new URL(server.url).host : null;

/** @type {{role: string, content: string, id?: string, status?: string, note?: string, finish?: string, wait?: string, el?: HTMLElement}[]} */
let turns = [];
let current = null; // the assistant turn that is streaming
let currentStream = null; // its ChatStream

// ---------------------------------------------------------------------------------------- banner

function showBanner(kind, parts) {
  ui.banner.dataset.kind = kind;
  ui.banner.replaceChildren(...parts.map((p) => (typeof p === "string" ? document.createTextNode(p) : p)));
  ui.banner.hidden = false;
}

function hideBanner() {
  ui.banner.hidden = true;
  ui.banner.replaceChildren();
}

// ---------------------------------------------------------------------------------------- connection

function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.statusText.textContent = text ?? stateText(state);
  showWaitInStatus();
}

/** The header's words for a connection state: offline, or the seconds left before the next attempt. */
function stateText(state, secs = retrySeconds()) {
  if (browserOffline && (state === "reconnecting" || state === "connecting")) return "Offline";
  if (state === "reconnecting") return secs > 0 ? `Reconnecting… (${secs} s)` : "Reconnecting…";
  return STATE_TEXT[state] ?? state;
}

// ---------------------------------------------------------------------------------------- retry countdown

// While the client waits out its backoff: when its next attempt is due (performance.now() time; null
// once it is under way), and the timer that counts the banner's seconds down to it.
const retry = { due: null, timer: null };

function retrySeconds() {
  return retry.due == null ? 0 : Math.ceil((retry.due - performance.now()) / 1000);
}

/** The header and the banner while reconnecting, again at each whole second until the attempt starts
 * (the client says nothing then: an attempt that fails brings the next `reconnecting`, one that works
 * `open`). */
function showRetry() {
  clearTimeout(retry.timer);
  retry.timer = null;
  if (client?.state !== "reconnecting") return;
  const secs = retrySeconds(); // read once: the header and the banner must not straddle a second
  setStatus("reconnecting", stateText("reconnecting", secs));
  const lead = browserOffline ? "You're offline." : `Can't reach the server at ${host}.`;
  const when = secs > 0 ? `Trying again in ${secs} s${browserOffline ? ", or as soon as the network is back" : ""}.` : "Trying again now…";
  showBanner("offline", [`${lead} ${when} `, "Your conversation is kept, and a reply in progress continues where it stopped."]);
  if (secs > 0) retry.timer = setTimeout(showRetry, retry.due - performance.now() - (secs - 1) * 1000);
}

/** The client started an attempt before its backoff ran out (the network came back). */
function retryUnderWay() {
  retry.due = null;
  showRetry();
}

function stopRetryCountdown() {
  clearTimeout(retry.timer);
  retry.timer = null;
  retry.due = null;
}

// ---------------------------------------------------------------------------------------- the network

// The browser's offline and online events, but not withBrowserLifecycle(client) as a whole:
// * its hidden -> pause() would close the socket of a tab merely in the background, and a reply left
//   with no connection for longer than the server's detach timeout (30 s by default) is cancelled: a
//   reply would end "interrupted" because its tab was behind another one. A desktop browser keeps a
//   background tab's socket alive, and the heartbeat finds one that died.
// * its offline -> setOnline(false) stops every retry until an `online` event, but `offline` is only a
//   hint: a server on this very machine stays reachable, and a browser can be wrong about its network.
//   A retry that fails costs nothing; an `online` that never comes would leave the page stranded.
// So: offline drops the socket now (the network took it, but only the heartbeat's unanswered ping
// would say so, 5 s later mid-reply and up to 18 s idle) and the client retries with its backoff;
// online reconnects at once. A reply in progress resumes from its offset either way: nothing is lost
// or repeated.
let browserOffline = navigator.onLine === false;
let stateEvents = 0; // client "state" events so far: did a call emit one?

function watchNetwork() {
  addEventListener("offline", () => {
    browserOffline = true;
    const seen = stateEvents;
    client.reconnectNow("the browser went offline");
    if (stateEvents === seen) refreshConnection(); // it was already reconnecting: an attempt started
  });
  addEventListener("online", () => {
    browserOffline = false;
    const seen = stateEvents;
    client.resume(); // reconnect now, skipping the backoff (an open socket is probed instead)
    if (stateEvents === seen) refreshConnection();
  });
}

/** The connection's words again after a network event that brought no new state from the client. */
function refreshConnection() {
  if (client.state === "reconnecting") retryUnderWay();
  else setStatus(client.state);
}

// ---------------------------------------------------------------------------------------- a reply that waits

// What a reply without progress waits for: the header's short text and the reply's own line.
const WAIT = {
  loading: { status: "Model loading…", note: (started) => `Queued: the model is still loading. This reply ${started ? "continues" : "starts"} as soon as it has loaded.` },
  queued: { status: "Queued…", note: () => "Queued: waiting for the server to start this reply…" },
  resume: { status: "Resuming reply…", note: () => "Waiting for the server to resume this reply…" },
  first: { status: "Waiting…", note: () => "Waiting for the server's first token…" },
};
// How long without a token before saying so: a queued chat usually starts at once, a resumed reply
// continues at once unless its server restarted, and tokens come several a second on a slow CPU.
const QUEUED_MS = 1500;
const RESUMED_MS = 2000;
const STALL_MS = 5000;

const progress = { at: 0, resumed: false, ticker: null };
let serverLoading = []; // welcome.loading of this connection; emptied once /readyz says the server is ready
let readyPoll = null;

/** The models a reply may be waiting for: its model (accepted.model), and the default's names. */
function replyModels(chatStream) {
  const model = chatStream.model;
  const def = client?.welcome?.models?.[0] ?? config.model;
  const names = new Set([model ?? "default"]);
  if (!model || model === "default" || model === def) {
    names.add("default");
    if (def) names.add(def);
  }
  return names;
}

/** Why the streaming reply makes no progress (a key of WAIT), or null while it does or cannot know. */
function waitKind() {
  if (!current || !currentStream || currentStream.ended || client?.state !== "open") return null;
  const state = currentStream.state;
  if (state !== "queued" && state !== "running") return null; // not accepted (yet) on this connection
  const names = replyModels(currentStream);
  if (serverLoading.some((m) => names.has(m))) return "loading";
  const idle = performance.now() - progress.at;
  if (progress.resumed) return idle >= RESUMED_MS ? "resume" : null;
  if (state === "queued") return idle >= QUEUED_MS ? "queued" : null;
  if (idle < STALL_MS) return null;
  return current.content ? "resume" : "first";
}

function updateWait() {
  const kind = waitKind();
  if (kind === "loading") watchReadiness();
  else stopReadinessWatch();
  if (current && (current.wait ?? null) !== kind) {
    current.wait = kind ?? undefined;
    schedulePaint(current);
  }
  showWaitInStatus();
}

function showWaitInStatus() {
  const kind = current?.wait;
  if (kind && ui.status.dataset.state === "open") {
    ui.status.dataset.wait = kind;
    ui.statusText.textContent = WAIT[kind].status;
  } else if (ui.status.dataset.wait) {
    delete ui.status.dataset.wait;
    ui.statusText.textContent = stateText(ui.status.dataset.state);
  }
}

/** While a reply waits for a loading model, ask this page's server (its /readyz) whether it is ready
 * now: welcome.loading is what the server knew when this connection opened. */
function watchReadiness() {
  if (readyPoll || !server.url || new URL(server.url).host !== location.host) return;
  readyPoll = setInterval(async () => {
    try {
      const r = await fetch(new URL("readyz", location.href), { cache: "no-store" });
      // A cluster's gateway answers 200 with a body that says when no live worker serves the model.
      if (r.ok && (await r.text()).trim() === "ready") {
        serverLoading = [];
        updateWait();
      }
    } catch {
      // not reachable: the connection's own state says so
    }
  }, 2000);
}

function stopReadinessWatch() {
  if (readyPoll) clearInterval(readyPoll);
  readyPoll = null;
}

/** Tokens came (or the reply was accepted again): the reply is not waiting, for now. */
function progressed() {
  progress.at = performance.now();
  updateWait();
}

if (client) {
  watchNetwork();
  client.on("state", ({ state, delay }) => {
    stateEvents += 1;
    // A `reconnecting` with a delay: an attempt failed and the next is due then; without one: an
    // attempt is under way.
    stopRetryCountdown();
    if (state === "reconnecting" && delay != null) retry.due = performance.now() + delay;
    setStatus(state);
    ui.status.title = client.welcome ? `server ${client.welcome.server}` : "";
    if (state === "reconnecting") {
      showRetry();
    } else if (state === "closed") {
      showBanner("offline", [`Disconnected from ${host}. Reload the page to connect again.`]);
    } else if (state === "open") {
      hideBanner();
      serverLoading = Array.isArray(client.welcome?.loading) ? client.welcome.loading.filter((m) => typeof m === "string") : [];
      // The server says which models it serves (a cluster's gateway knows them only from its workers).
      if (Array.isArray(client.welcome?.models) && client.welcome.models.length) showModels(client.welcome.models);
    }
    updateWait();
  });
  // A reconnect resumes the streaming reply: from then on a short silence means it waits for the server.
  client.on("resume", ({ points }) => {
    if (current?.id && points.some((p) => p.id === current.id)) progress.resumed = true;
  });
  client.on("frame", (frame) => {
    // The stream's state (queued, running) is set right after this event.
    if (frame.type === "accepted" && frame.id === current?.id) queueMicrotask(progressed);
  });
} else {
  // Refused: say so where it cannot be missed, and keep everything in this browser.
  setStatus("refused");
  const back = document.createElement("a");
  back.href = location.pathname;
  back.textContent = "Use this server instead";
  showBanner("refused", [
    `Not connecting to ${server.refused}: this page only connects to the server it was loaded from${config.connect.length ? " and the servers that server lists" : ""}. Nothing was sent. `,
    back,
  ]);
  ui.prompt.disabled = true;
  ui.send.disabled = true;
}

// ---------------------------------------------------------------------------------------- models

/** The model picker: shown when the server serves more than one model; the choice is kept. */
function showModels(models) {
  const names = models.filter((m) => typeof m === "string" && m);
  if (names.length < 2) {
    ui.model.hidden = true;
    return;
  }
  const chosen = localStorage.getItem(`${STORE}model`);
  ui.model.replaceChildren(
    ...names.map((name, i) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = i === 0 ? `${name} (default)` : name;
      return option;
    }),
  );
  ui.model.value = names.includes(chosen) ? chosen : names[0];
  ui.model.hidden = false;
  ui.modelName.textContent = ui.model.value;
}

ui.model.addEventListener("change", () => {
  localStorage.setItem(`${STORE}model`, ui.model.value);
  ui.modelName.textContent = ui.model.value;
});

// ---------------------------------------------------------------------------------------- settings

function loadOverrides() {
  try {
    const s = JSON.parse(localStorage.getItem(`${STORE}settings.v2`) || "{}");
    return s && typeof s === "object" ? s : {};
  } catch {
    return {};
  }
}

function fillSettings(overrides) {
  for (const f of FIELDS) {
    const v = overrides[f.key];
    f.el.value = Number.isFinite(v) ? v : config.defaults[f.key];
  }
  ui.seed.value = typeof overrides.seed === "string" ? overrides.seed : "";
  ui.cache.checked = overrides.cache !== false;
}

const MAX_SEED = 2n ** 63n - 1n;

/** The sampling parameters of the settings panel (a seed only when one is given: same seed, same reply). */
function settings() {
  const p = {};
  for (const f of FIELDS) {
    let v = Number(f.el.value);
    if (!Number.isFinite(v) || f.el.value.trim() === "") v = config.defaults[f.key];
    v = Math.min(f.max, Math.max(f.min, f.integer ? Math.round(v) : v));
    if (f.key === "max_tokens") v = Math.min(v, config.maxTokens);
    p[f.key] = v;
  }
  const seed = ui.seed.value.trim();
  if (/^\d{1,19}$/.test(seed) && BigInt(seed) <= MAX_SEED) p.seed = BigInt(seed);
  if (!ui.cache.checked) p.cache = false;
  if (!ui.model.hidden && ui.model.value) p.model = ui.model.value;
  return p;
}

/** Only what differs from the server's defaults is kept, so a change of defaults reaches returning users. */
function saveSettings() {
  const s = settings();
  const overrides = {};
  for (const f of FIELDS) if (s[f.key] !== config.defaults[f.key]) overrides[f.key] = s[f.key];
  if (ui.seed.value.trim()) overrides.seed = ui.seed.value.trim();
  if (!ui.cache.checked) overrides.cache = false;
  localStorage.setItem(`${STORE}settings.v2`, JSON.stringify(overrides));
}

for (const input of [...FIELDS.map((f) => f.el), ui.seed, ui.cache]) input.addEventListener("change", saveSettings);

ui.resetSettings.addEventListener("click", () => {
  localStorage.removeItem(`${STORE}settings.v2`);
  fillSettings({});
});

function toggleSettings(open = ui.settingsPanel.hidden) {
  ui.settingsPanel.hidden = !open;
  ui.settingsToggle.setAttribute("aria-expanded", String(open));
}

ui.settingsToggle.addEventListener("click", () => toggleSettings());
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && !ui.settingsPanel.hidden) toggleSettings(false);
});

const d = config.defaults;
ui.defaultsNote.textContent = `Server defaults: temperature ${d.temperature}, top p ${d.top_p}, max tokens ${d.max_tokens}, repetition penalty ${d.repetition_penalty}, frequency penalty ${d.frequency_penalty}.`;

// ---------------------------------------------------------------------------------------- conversation

function save() {
  // A reply still streaming keeps its request, so that a page opened again can send it again with the
  // same id if the server never took it (sent offline, the tab closed before the network came back).
  const plain = turns.map(({ role, content, id, status, note, finish, model, request }) => ({ role, content, id, status, note, finish, model, request: status === "streaming" ? request : undefined }));
  try {
    localStorage.setItem(`${STORE}conversation`, JSON.stringify(plain));
  } catch {
    // storage full or disabled: the page still works
  }
}

function updateEmpty() {
  ui.empty.hidden = turns.length > 0;
}

function addTurn(turn) {
  const el = document.createElement("article");
  el.className = `turn ${turn.role}`;
  const who = document.createElement("div");
  who.className = "who";
  const content = document.createElement("div");
  content.className = "content";
  const wait = document.createElement("div");
  wait.className = "wait";
  wait.setAttribute("role", "status");
  const note = document.createElement("div");
  note.className = "note";
  el.append(who, content, wait, note);
  ui.conversation.appendChild(el);
  turn.el = el;
  turns.push(turn);
  updateEmpty();
  paint(turn);
  return turn;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // No clipboard API (an insecure origin): select the text and use the old command.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.appendChild(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

/** A Copy button on each code block of a rendered reply. */
function addCopyButtons(content) {
  for (const pre of content.querySelectorAll("pre")) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy code");
    button.addEventListener("click", async () => {
      const ok = await copyText(pre.querySelector("code")?.textContent ?? pre.textContent);
      button.textContent = ok ? "Copied" : "Copy failed";
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
    pre.classList.add("has-copy");
    pre.prepend(button);
  }
}

function paint(turn) {
  const el = turn.el;
  el.dataset.status = turn.status ?? "done";
  if (turn.finish) el.dataset.finish = turn.finish;
  else delete el.dataset.finish;
  if (turn.id) el.dataset.requestId = turn.id;
  if (turn.wait) el.dataset.wait = turn.wait;
  else delete el.dataset.wait;
  // The model that answered (accepted.model: the one picked, or a lighter one the server fell back to).
  el.querySelector(".who").textContent = turn.role === "user" ? "You" : (turn.model ?? config.model ?? "Model");
  const content = el.querySelector(".content");
  if (turn.role === "user") content.textContent = turn.content;
  else {
    content.replaceChildren(renderMarkdown(turn.content));
    if (turn.status !== "streaming") addCopyButtons(content);
  }
  el.querySelector(".wait").textContent = turn.wait ? WAIT[turn.wait].note(turn.content.length > 0) : "";
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
  ui.send.hidden = busy; // Stop takes Send's place: the message box keeps its width on a phone
  document.body.classList.toggle("busy", busy);
}

/** The note under a reply that ended `length` (SPEC §12): the model's context window full, or its
 * max_tokens reached: as the page asked (`asked`; unknown for a reply resumed by id alone), as lowered
 * to the server's own cap (`cap`, welcome.limits.max_tokens: a page pointed at another server, or whose
 * config.json did not load, may ask for more), or as lowered by a server busy under load (SPEC §4.2).
 * `result.lengthReason` says which limit: "context" wants a new chat, and raising Max tokens would change
 * nothing; "max_tokens" below `asked` and below `cap` was the busy server's doing, and asking later may
 * give more. A server before length_reason says nothing (null): then a reply shorter than `asked` is
 * taken for a full window, though a server lowering max_tokens under load reads the same. */
function lengthNote(result, asked, cap) {
  const n = result.offset ?? result.usage?.completion_tokens;
  const short = Number.isInteger(asked) && Number.isInteger(n) && n < asked;
  const capped = short && Number.isInteger(cap) && cap < asked && n >= cap;
  const limit = result.lengthReason ?? (short && !capped ? "context" : "max_tokens");
  if (limit === "context") {
    return `The reply was cut off after ${n} tokens: the conversation is too long for the model's context window${short ? ` (Max tokens, ${asked}, was not reached)` : ""}. Start a New chat to get longer replies.`;
  }
  if (capped) return `The reply hit this server's limit of ${cap} tokens a reply (Max tokens, ${asked}, is above it) and was cut off.`;
  if (short) return `The server was busy and shortened the reply to ${n} tokens (Max tokens is ${asked}). Asking again later may give a longer one.`;
  return `The reply hit the max tokens limit${n ? ` (${n} tokens)` : ""} and was cut off. Raise Max tokens in Settings for longer replies.`;
}

async function stream(turn, chatStream, { resumed = false } = {}) {
  current = turn;
  currentStream = chatStream;
  turn.id = chatStream.id;
  turn.status = "streaming";
  turn.note = "";
  turn.finish = "";
  turn.wait = undefined;
  progress.resumed = resumed;
  progress.at = performance.now();
  clearInterval(progress.ticker);
  progress.ticker = setInterval(updateWait, 500);
  paint(turn);
  save();
  setBusy(true);
  try {
    for await (const item of chatStream) {
      if (item.type === "reset") turn.content = "";
      else turn.content += item.text;
      if (chatStream.model) turn.model = chatStream.model;
      if (item.type === "delta") progressed();
      schedulePaint(turn);
    }
    if (chatStream.model) turn.model = chatStream.model;
    const result = await chatStream.result;
    turn.status = result.finishReason === "cancelled" ? "cancelled" : "done";
    turn.finish = result.finishReason;
    // Cancelled by the server's detach timeout (nobody attached for it: the page was asleep or offline
    // too long) is not the user's Stop, and says so.
    if (result.finishReason === "cancelled") turn.note = result.cancelReason === "detach_timeout" ? "interrupted (the page was away too long)" : "stopped";
    else if (result.finishReason === "length") turn.note = lengthNote(result, turn.request?.params?.max_tokens, client.welcome?.limits?.max_tokens);
    else turn.note = "";
  } catch (err) {
    turn.status = "error";
    turn.note = `error: ${err.code ?? ""} ${err.message ?? err}`.trim();
  } finally {
    clearInterval(progress.ticker);
    stopReadinessWatch();
    turn.wait = undefined;
    if (paintScheduled) cancelAnimationFrame(paintScheduled);
    paintScheduled = null;
    // A reply followed to its end keeps its end in view: the note under it (cut at max tokens, stopped,
    // an error) is part of the conversation, not something left under the message box.
    const stick = nearBottom();
    paint(turn);
    if (stick) scrollToEnd();
    delete turn.request;
    if (current === turn) {
      current = null;
      currentStream = null;
    }
    // Another tab of this page changed the conversation while this reply streamed: if it went on without
    // this reply (New chat there), show what it has; else this reply's end is the newest state.
    const other = otherTabChanged ? storedTurns() : null;
    otherTabChanged = false;
    if (other && !other.some((t) => t.id === turn.id)) adopt(other);
    else save();
    showWaitInStatus();
    setBusy(false);
    if (!coarse) ui.prompt.focus();
  }
}

function ask(text) {
  if (!client) return;
  // The conversation so far (stopped replies included, as far as they got), then the new question.
  const messages = turns
    .filter((t) => t.content && t.status !== "error")
    .map((t) => ({ role: t.role, content: t.content }));
  messages.push({ role: "user", content: text });
  const params = settings();
  addTurn({ role: "user", content: text, status: "done" });
  const reply = addTurn({ role: "assistant", content: "", status: "streaming" });
  // Kept (with the reply, while it streams) as JSON: the seed is a BigInt.
  reply.request = { messages, params: { ...params, seed: params.seed?.toString() } };
  scrollToEnd();
  return stream(reply, client.chat(messages, params));
}

/** A reply that was streaming when this page last ran, followed again from its start: its chat sent
 * again with the same id (the server attaches to the request if it took it, else starts it: a question
 * sent offline is not lost), or, for a turn saved without its request, resumed by id. */
function follow(turn) {
  turn.content = "";
  const r = turn.request;
  let chatStream = null;
  if (r && Array.isArray(r.messages) && r.params && typeof r.params === "object") {
    try {
      const params = { ...r.params };
      if (typeof params.seed === "string") params.seed = BigInt(params.seed);
      else delete params.seed;
      chatStream = client.chat(r.messages, params, { id: turn.id });
    } catch {
      chatStream = null; // not a request this client can send: resume it by id instead
    }
  }
  return stream(turn, chatStream ?? client.resume(turn.id), { resumed: true });
}

function submit() {
  const text = ui.prompt.value.trim();
  if (!text || current || !client) return;
  ui.prompt.value = "";
  autosize();
  ask(text);
}

ui.form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  submit();
});

// On a phone (coarse pointer) Enter makes a new line and Send sends; with a keyboard Enter sends.
const coarse = matchMedia("(pointer: coarse)").matches;
ui.prompt.placeholder = coarse ? "Ask something…" : "Ask something… (Enter to send, Shift+Enter for a new line)";
ui.prompt.addEventListener("keydown", (ev) => {
  if (!coarse && ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    submit();
  }
});

function autosize() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight + 2, 200)}px`;
}
ui.prompt.addEventListener("input", autosize);

ui.stop.addEventListener("click", () => {
  if (!current?.id || !client) return;
  const turn = current;
  client.cancel(turn.id);
  // Offline, the stop goes out when the connection is back (and the reply ends "stopped" then): say so
  // now, so that a click is never met with nothing.
  if (current === turn && client.state !== "open") {
    turn.note = "Stopping: the server is told as soon as the connection is back.";
    schedulePaint(turn);
  }
});

ui.newChat.addEventListener("click", () => {
  if (current?.id) client?.cancel(current.id);
  turns = [];
  current = null;
  for (const el of [...ui.conversation.querySelectorAll(".turn")]) el.remove();
  updateEmpty();
  save();
  setBusy(false);
  ui.prompt.focus();
});

for (const example of document.querySelectorAll(".example")) {
  example.addEventListener("click", () => {
    if (!current && client) ask(example.textContent);
  });
}

// ---------------------------------------------------------------------------------------- start

function storedTurns() {
  let saved = [];
  try {
    saved = JSON.parse(localStorage.getItem(`${STORE}conversation`) || "[]");
  } catch {
    saved = [];
  }
  return (Array.isArray(saved) ? saved : []).filter((t) => t && (t.role === "user" || t.role === "assistant") && typeof t.content === "string");
}

/** Show `saved` as the conversation; a reply in it that was streaming is followed live. */
function adopt(saved) {
  for (const el of [...ui.conversation.querySelectorAll(".turn")]) el.remove();
  turns = [];
  for (const t of saved) addTurn({ ...t });
  updateEmpty();
  const last = turns[turns.length - 1];
  if (client && last && last.role === "assistant" && last.status === "streaming" && last.id) {
    // The page was reloaded mid-reply (or another tab is streaming it): follow it from its start.
    follow(last);
  }
  scrollToEnd();
}

function restore() {
  adopt(storedTurns());
}

// Two tabs of this page share the conversation: one idle shows what another saved (a new question, a
// reply that streams there, a New chat), so that neither writes over the other's turns later.
let otherTabChanged = false;
addEventListener("storage", (ev) => {
  if (ev.key !== `${STORE}conversation` && ev.key !== null) return;
  if (current) otherTabChanged = true; // looked at when this tab's reply ends
  else adopt(storedTurns());
});

if (config.model) ui.modelName.textContent = config.model;
showModels(config.models);
fillSettings(loadOverrides());
restore();
updateEmpty();
if (!coarse) ui.prompt.focus();

// For debugging from the console (and the browser tests): the client, the config and the conversation.
globalThis.tokenwireUI = {
  client,
  config,
  server,
  get turns() {
    return turns.map(({ role, content, id, status, note, finish, model, wait }) => ({ role, content, id, status, note, finish, model, wait: wait ?? null }));
  },
};
