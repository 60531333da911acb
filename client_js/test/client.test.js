// The client against the real `tokenwire serve` (tiny model): streaming over both subprotocols, the
// socket killed mid-stream, a connection that silently stops delivering, an unaccepted chat retried
// with the same id, cancel, the session token kept in pluggable storage, and the gateway's UI files.
import assert from "node:assert/strict";
import http from "node:http";
import { after, before, test } from "node:test";

import WebSocket from "ws";

import { MemoryStorage, TokenwireClient, backoffDelay, createCodec } from "../src/index.js";
import { Proxy } from "../testing/proxy.js";
import { findLongReply } from "../testing/replies.js";
import { startServer } from "../testing/server.js";

let server;
let proxy;
const clients = [];

before(async () => {
  server = await startServer();
  proxy = await new Proxy(server.port).start();
});

after(async () => {
  for (const c of clients) c.close();
  await proxy?.close();
  if (server) assert.equal((await server.stop()).code, 0, "tokenwire serve did not exit cleanly");
});

const FAST = { initialMs: 50, maxMs: 400 };

/** A client whose sent frames are recorded (decoded), for assertions on what went over the wire. */
function newClient(url, options = {}) {
  const sent = [];
  class RecordingWebSocket extends WebSocket {
    send(data) {
      const codec = createCodec(this.protocol);
      sent.push(codec.decode(typeof data === "string" ? data : data));
      super.send(data);
    }
  }
  const client = new TokenwireClient(url, { WebSocket: RecordingWebSocket, storage: new MemoryStorage(), backoff: FAST, ...options });
  client.sent = sent;
  client.states = [];
  client.on("state", (ev) => client.states.push(ev));
  clients.push(client);
  return client;
}

/** Iterate a stream; returns {text, items, result}; `onDelta(item, items)` may act mid-stream. */
async function consume(stream, onDelta = () => {}) {
  const items = [];
  let text = "";
  for await (const item of stream) {
    items.push(item);
    if (item.type === "reset") text = "";
    else text += item.text;
    await onDelta(item, items);
  }
  return { text, items, result: await stream.result };
}

/** Deltas cover 0..done.offset without a gap or an overlap, and their text is the whole reply. */
function assertContiguous({ items, text, result }) {
  let pos = 0;
  for (const d of items) {
    assert.equal(d.type, "delta", "no reset expected");
    assert.equal(d.offset, pos, "offsets must be contiguous");
    pos += d.n;
  }
  assert.equal(result.offset, pos);
  assert.equal(result.usage.completion_tokens, pos);
  assert.ok(Number.isInteger(result.usage.cached_tokens) && result.usage.cached_tokens <= result.usage.prompt_tokens);
  assert.equal(result.text, text);
}

const MESSAGES = [{ role: "user", content: "Tell me a long story about tokens" }];
// Sampled with a fixed seed (found by findLongReply), so an interrupted stream can be compared with the
// uninterrupted one character for character; never from the response cache, which would answer a
// repeated seeded request at once, leaving nothing to interrupt.
let LONG = { temperature: 1, max_tokens: 160, cache: false };
let referenceText;

async function reference() {
  if (referenceText === undefined) {
    const found = await findLongReply(server.url, MESSAGES, LONG);
    LONG = found.params;
    assert.equal(found.result.offset, LONG.max_tokens);
    referenceText = found.result.text;
  }
  return referenceText;
}

test("backoff: exponential cap, full jitter", () => {
  const opts = { initialMs: 100, maxMs: 2000 };
  assert.equal(backoffDelay(0, { ...opts, random: () => 0.999999 }), 99);
  assert.equal(backoffDelay(3, { ...opts, random: () => 0.999999 }), 799);
  assert.equal(backoffDelay(30, { ...opts, random: () => 0.999999 }), 1999);
  assert.equal(backoffDelay(5, { ...opts, random: () => 0 }), 0);
  const spread = new Set(Array.from({ length: 50 }, () => backoffDelay(4, opts)));
  assert.ok(spread.size > 10, "delays are jittered");
});

test("streams a chat over msgpack and over JSON, with the same text for the same seed", async () => {
  const texts = [];
  for (const sub of ["msgpack", "json"]) {
    const c = newClient(server.url, { subprotocols: [sub] });
    const stream = c.chat(MESSAGES, { max_tokens: 24, temperature: 0.8, seed: 7, cache: false });
    const run = await consume(stream);
    assert.equal(c.subprotocol, `tokenwire.v1.${sub}`);
    assertContiguous(run);
    assert.ok(run.items.length >= 2, "streamed in several deltas");
    assert.ok(run.text.length > 0);
    assert.equal(run.result.id, stream.id);
    assert.equal(stream.text, run.text);
    texts.push(run.text);
    c.close();
  }
  assert.equal(texts[0], texts[1]);
});

test("content mode: the session token is stored, and a new client with that storage owns its requests", async () => {
  const storage = new MemoryStorage();
  const a = newClient(server.url, { storage, storageKey: "tw-test" });
  const first = await consume(a.chat("Hello", { max_tokens: 12, seed: 3, cache: false }));
  assertContiguous(first);
  const token = storage.getItem("tw-test");
  assert.equal(token, a.welcome.session_token);
  const session = a.welcome.session;
  a.close();

  const b = newClient(server.url, { storage, storageKey: "tw-test" });
  await b.connect();
  assert.equal(b.sent[0].session_token, token, "hello carries the stored session token");
  assert.equal(b.welcome.session, session, "same session reclaimed");
  const replay = await consume(b.resume(first.result.id));
  assert.equal(replay.text, first.text, "the whole log replays from offset 0");
  assert.equal(replay.result.offset, first.result.offset);

  // Without the token, a request of that session is not ours.
  const stranger = newClient(server.url);
  await assert.rejects(stranger.resume(first.result.id).result, { code: "not_found" });
});

test("socket killed mid-stream: reconnect and resume, no duplicated or missing text", async () => {
  const expected = await reference();
  const c = newClient(proxy.wsUrl);
  const resumes = [];
  c.on("resume", (ev) => resumes.push(ev.points));
  let cutAt = null;
  const stream = c.chat(MESSAGES, LONG);
  const run = await consume(stream, (item) => {
    if (cutAt === null && stream.offset >= 10) {
      cutAt = stream.offset;
      assert.ok(proxy.cut() >= 1, "a connection was cut");
      proxy.refuse(300); // unreachable for a moment: at least one failed attempt
    }
  });
  assert.ok(cutAt !== null && cutAt < LONG.max_tokens, "cut mid-stream");
  assertContiguous(run);
  assert.equal(run.text, expected, "same text as the uninterrupted reply");
  // The reconnect resumed this request at the offset held when the socket died, with its epoch.
  assert.deepEqual(resumes[0], [{ id: stream.id, offset: cutAt, epoch: 1 }]);
  const hellos = c.sent.filter((f) => f.type === "hello");
  assert.equal(hellos.length >= 2, true);
  assert.deepEqual(hellos.at(-1).resume, [{ id: stream.id, offset: cutAt, epoch: 1 }]);
  assert.equal(hellos.at(-1).session_token, hellos[0].session_token ?? c.sessionToken);
  assert.equal(c.sent.filter((f) => f.type === "chat").length, 1, "the accepted chat is resumed, never re-sent");
  const states = c.states.map((s) => s.state);
  assert.deepEqual(states.slice(0, 2), ["connecting", "open"]);
  assert.ok(states.includes("reconnecting"));
  assert.equal(states.at(-1), "open");
  // The server's log agrees: a fresh replay gives the same text.
  const replay = await consume(c.resume(stream.id));
  assert.equal(replay.text, expected);
});

test("a chat sent but not yet accepted is retried with the same id after a reconnect", async () => {
  const expected = await reference();
  const c = newClient(proxy.wsUrl);
  await c.connect();
  const stream = c.chat(MESSAGES, LONG);
  // Cut before any answer can come back: the client cannot know whether the chat arrived.
  proxy.cut();
  const run = await consume(stream);
  const chats = c.sent.filter((f) => f.type === "chat");
  assert.equal(chats.length, 2, "sent once, then once more after the reconnect");
  assert.deepEqual(chats[1], chats[0], "the identical frame (same id, same payload)");
  assertContiguous(run);
  assert.equal(run.text, expected);
});

test("a connection that silently stops delivering is detected by the heartbeat within seconds", async () => {
  const expected = await reference();
  const c = newClient(proxy.wsUrl); // default heartbeat settings
  let blackholedAt = null;
  let lost = null;
  c.on("reconnecting", (ev) => {
    if (blackholedAt && !lost) lost = { ms: Date.now() - blackholedAt, code: ev.code, reason: ev.reason };
  });
  const stream = c.chat(MESSAGES, LONG);
  const run = await consume(stream, () => {
    if (blackholedAt === null && stream.offset >= 5) {
      assert.ok(proxy.blackhole() >= 1);
      blackholedAt = Date.now();
    }
  });
  assert.ok(lost, "the dead connection was noticed");
  assert.equal(lost.code, 4003, `noticed by the heartbeat (${lost.reason})`);
  assert.ok(lost.ms < 6500, `noticed after ${lost.ms} ms`);
  assertContiguous(run);
  assert.equal(run.text, expected);
});

test("cancel ends the stream with finish reason cancelled, at the tokens generated so far", async () => {
  const c = newClient(server.url);
  await reference();
  const stream = c.chat(MESSAGES, { ...LONG, max_tokens: 400 });
  let asked = false;
  const run = await consume(stream, () => {
    if (!asked && stream.offset >= 3) {
      asked = true;
      c.cancel(stream.id);
    }
  });
  assert.equal(run.result.finishReason, "cancelled");
  assert.ok(run.result.offset < 400);
  assertContiguous(run);
  assert.deepEqual(c.sent.filter((f) => f.type === "cancel"), [{ type: "cancel", id: stream.id }]);
});

test("a content-mode turn sent while the previous one runs is shown waiting, then streams", async () => {
  const c = newClient(server.url);
  const waits = [];
  c.on("waiting", (ev) => waits.push(ev));
  const first = c.chat("Tell me about the sea", { max_tokens: 48, seed: 1, cache: false });
  const second = c.chat("And the mountains?", { max_tokens: 8, seed: 2, cache: false });
  const states = new Set();
  const watch = setInterval(() => states.add(second.state), 5);
  try {
    const [a, b] = await Promise.all([consume(first), consume(second)]);
    assertContiguous(a);
    assertContiguous(b);
  } finally {
    clearInterval(watch);
  }
  assert.deepEqual(waits, [{ id: second.id, after: first.id }]);
  assert.ok(states.has("waiting"), `states seen: ${[...states]}`);
  assert.equal(second.state, "done");
  c.close();
});

test("Stop of a turn still waiting ends it cancelled, and it never runs", async () => {
  const c = newClient(server.url);
  const waiting = new Promise((resolve) => c.on("waiting", resolve));
  const first = c.chat("Tell me about the sea", { max_tokens: 48, seed: 1, cache: false });
  const second = c.chat("And the mountains?", { max_tokens: 8, seed: 2, cache: false });
  await waiting;
  second.cancel();
  const b = await consume(second);
  assert.equal(b.result.finishReason, "cancelled");
  assert.equal(b.result.offset, 0);
  assert.equal(second.state, "cancelled");
  const a = await consume(first); // the earlier turn is not harmed
  assert.equal(first.state, "done");
  assertContiguous(a);
  // The server never created it: a resume finds nothing.
  const third = c.resume(second.id);
  await assert.rejects(consume(third), (err) => err.code === "not_found");
  c.close();
});

test("coalesceMs is sent in the hello and checked before anything is sent", async () => {
  const c = newClient(server.url, { coalesceMs: 100 });
  await c.connect();
  assert.equal(c.sent[0].coalesce_ms, 100);
  const run = await consume(c.chat(MESSAGES, { max_tokens: 16, seed: 4, cache: false }));
  assertContiguous(run);
  c.close();
  assert.throws(() => newClient(server.url, { coalesceMs: 5000, autoConnect: false }), RangeError);
});

test("a repeated deterministic request may come from the response cache: same text, state done", async () => {
  const c = newClient(server.url);
  const accepted = [];
  c.on("frame", (f) => f.type === "accepted" && accepted.push(f));
  const params = { temperature: 1, seed: 11, max_tokens: 20 };
  const first = await consume(c.chat(MESSAGES, params));
  const again = await consume(c.chat(MESSAGES, params));
  assertContiguous(first);
  assertContiguous(again);
  assert.equal(again.text, first.text);
  assert.equal(again.result.offset, first.result.offset);
  assert.equal(accepted[1].state, "done", "answered from the cache, not generated again");
});

test("a request this owner does not have fails with not_found", async () => {
  const c = newClient(server.url);
  await assert.rejects(consume(c.resume("no-such-request")), { name: "TokenwireError", code: "not_found" });
});

test("an application ping measures the round trip", async () => {
  const c = newClient(server.url);
  await c.connect();
  const rtt = await c.ping();
  assert.ok(rtt >= 0 && rtt < 2000);
});

/** GET a raw path (no URL normalisation, so ../ reaches the server as written). */
function get(path) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: "127.0.0.1", port: server.port, path, method: "GET" }, (res) => {
      const chunks = [];
      res.on("data", (c) => chunks.push(c));
      res.on("end", () => resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks).toString("utf8") }));
    });
    req.on("error", reject);
    req.end();
  });
}

test("the gateway serves the UI and its modules from client_js/, and nothing else", async () => {
  const index = await get("/");
  assert.equal(index.status, 200);
  assert.equal(index.headers["content-type"], "text/html; charset=utf-8");
  const csp = index.headers["content-security-policy"];
  assert.match(csp, /script-src 'self'(;|$)/);
  // WebSockets to this server only (no bare ws:/wss: that would allow any host; ?ws= is checked too).
  assert.match(csp, new RegExp(`connect-src 'self' ws://127\\.0\\.0\\.1:${server.port} wss://127\\.0\\.0\\.1:${server.port};`));
  assert.doesNotMatch(csp, / wss?:( |;)/);
  // One set of sampling defaults, served to the UI by the server.
  const config = await get("/config.json");
  assert.equal(config.status, 200);
  assert.equal(config.headers["content-type"], "application/json");
  const c = JSON.parse(config.body);
  // server/defaults.py, chosen by tokenwire eval: greedy with a frequency penalty against loops.
  assert.deepEqual(c.defaults, { temperature: 0, top_p: 0.9, max_tokens: 256, repetition_penalty: 1, frequency_penalty: 0.3 });
  assert.deepEqual(c.connect, []);
  assert.doesNotMatch(csp, /unsafe-inline|unsafe-eval/);
  assert.match(index.body, /<script type="module" src="ui\/app.js"><\/script>/);
  assert.doesNotMatch(index.body, /<script>|<script [^>]*>[^<]/, "no inline script");
  assert.doesNotMatch(index.body, /https?:\/\//, "nothing from another origin");
  for (const [path, type] of [
    ["/ui/app.js", "text/javascript; charset=utf-8"],
    ["/ui/markdown.js", "text/javascript; charset=utf-8"],
    ["/ui/style.css", "text/css; charset=utf-8"],
    ["/src/browser.js", "text/javascript; charset=utf-8"],
    ["/vendor/msgpack/index.mjs", "text/javascript; charset=utf-8"],
  ]) {
    const r = await get(path);
    assert.equal(r.status, 200, path);
    assert.equal(r.headers["content-type"], type, path);
    assert.equal(r.headers["x-content-type-options"], "nosniff");
  }
  for (const path of [
    "/ui/../../README.md",
    "/ui/%2e%2e/%2e%2e/README.md",
    "/src/..%2f..%2fserver/cli.py",
    "/vendor/msgpack/LICENSE",
    "/ui/missing.js",
    "/node_modules/ws/index.js",
    "/package.json",
    "/src/",
    "/../README.md",
  ]) {
    assert.equal((await get(path)).status, 404, path);
  }
  assert.equal((await get("/healthz")).status, 200);
  assert.equal((await get("/readyz")).status, 200);
});
