// The app lifecycle (issue 27) against the fake server: pause() closes cleanly after its grace and never
// cancels, nothing reconnects while paused or offline, resume() reconnects at once and the reply goes on
// from its offset; Stop works after such a reconnect; a reply persisted by one client is restored by a
// new one with the same storage (the app killed and relaunched), nothing repeated or missing; the
// React Native and browser adapters call the right methods.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import WebSocket from "ws";

import { MemoryStorage, TokenwireClient, mmkvStorage, withAppState, withBrowserLifecycle, withNetInfo } from "../src/index.js";
import { FakeServer } from "../testing/fake-server.js";

const TOKENS = Array.from({ length: 30 }, (_, i) => `t${i} `);
const FULL = TOKENS.join("");
const servers = [];
const clients = [];

after(async () => {
  for (const c of clients) c.close();
  for (const s of servers) await s.close();
});

async function fake(opts = {}) {
  const s = await new FakeServer({ reply: () => TOKENS, delayMs: 10, ...opts }).start();
  servers.push(s);
  return s;
}

function client(url, opts = {}) {
  const c = new TokenwireClient(url, { WebSocket, storage: new MemoryStorage(), backoff: { initialMs: 20, maxMs: 50 }, ...opts });
  clients.push(c);
  return c;
}

async function until(cond, what, ms = 10000) {
  const deadline = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`timed out: ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

async function drain(stream) {
  for await (const _ of stream); // the items; the stream ends after done
  return stream.result;
}

test("pause closes after its grace, nothing reconnects while paused, resume continues the reply", async () => {
  const server = await fake({ holdAt: () => 5 });
  const c = client(server.url);
  await c.connect();
  const stream = c.chat("hi", {}, { id: "r1" });
  await until(() => stream.offset === 5, "5 tokens");
  c.pause({ graceMs: 50 });
  await until(() => c.state === "paused", "paused");
  await until(() => server.sockets.size === 0, "the socket closed");
  server.release("r1"); // the server goes on meanwhile
  await new Promise((r) => setTimeout(r, 300));
  assert.equal(server.connections, 1, "no reconnect while paused");
  assert.ok(!server.received.some((f) => f.type === "cancel"), "pausing is never a cancel");
  c.resume();
  const done = await drain(stream);
  assert.equal(done.finishReason, "stop");
  assert.equal(stream.text, FULL); // nothing lost, nothing repeated
  assert.equal(server.connections, 2);
  const hello = server.received.filter((f) => f.type === "hello").at(-1);
  assert.deepEqual(hello.resume.map((p) => [p.id, p.offset]), [["r1", 5]]);
});

test("a resume within the grace keeps the socket", async () => {
  const server = await fake();
  const c = client(server.url);
  await c.connect();
  c.pause({ graceMs: 500 });
  c.resume();
  await new Promise((r) => setTimeout(r, 700));
  assert.equal(c.state, "open");
  assert.equal(server.connections, 1);
});

test("Stop works after a reconnect", async () => {
  const server = await fake({ holdAt: () => 4 });
  const c = client(server.url);
  await c.connect();
  const stream = c.chat("hi", {}, { id: "r2" });
  await until(() => stream.offset === 4, "4 tokens");
  c.pause({ graceMs: 0 });
  await until(() => c.state === "paused", "paused");
  c.resume();
  await until(() => c.state === "open" && server.connections === 2, "reconnected");
  c.cancel("r2");
  const done = await drain(stream);
  assert.equal(done.finishReason, "cancelled");
  assert.equal(server.received.filter((f) => f.type === "cancel").length, 1);
});

test("offline: a lost socket waits instead of retrying; online reconnects at once", async () => {
  const server = await fake();
  const c = client(server.url, { backoff: { initialMs: 5, maxMs: 5 } });
  await c.connect();
  c.setOnline(false);
  server.dropAll();
  await until(() => c.state === "offline", "offline");
  await new Promise((r) => setTimeout(r, 300));
  assert.equal(server.connections, 1, "no attempts while offline");
  c.setOnline(true);
  await until(() => c.state === "open", "open again");
  assert.equal(server.connections, 2);
});

test("a reply persisted before the app was killed is restored by a new client, whole", async () => {
  const server = await fake({ holdAt: () => 10 });
  const storage = new MemoryStorage();
  const a = client(server.url, { storage, persist: storage });
  await a.connect();
  const first = a.chat("hi", {}, { id: "r3" });
  await until(() => first.offset === 10, "10 tokens");
  const inflight = `tokenwire:session_token:${server.url}:inflight`; // storageKey + ":inflight"
  await until(() => JSON.parse(storage.getItem(inflight) ?? "{}").r3?.offset === 10, "offset 10 persisted");
  a.close(); // the app is killed (close keeps what is persisted)
  server.release("r3"); // the reply finishes meanwhile on the server
  const b = client(server.url, { storage, persist: storage });
  const restored = await b.restore();
  assert.deepEqual(restored.map((r) => r.id), ["r3"]);
  const stream = restored[0].stream;
  assert.equal(stream.text, TOKENS.slice(0, 10).join("")); // shown at once, before any frame
  const done = await drain(stream);
  assert.equal(done.finishReason, "stop");
  assert.equal(stream.text, FULL);
  const resumed = server.received.filter((f) => f.type === "hello").at(-1);
  assert.deepEqual(resumed.resume.map((p) => [p.id, p.offset]), [["r3", 10]]);
  await until(() => storage.getItem(inflight) === null, "cleared once done and handed over");
});

test("a corrupt persisted entry restores nothing and does not throw", async () => {
  const server = await fake();
  const storage = new MemoryStorage();
  const c = client(server.url, { storage, persist: storage, autoConnect: false });
  storage.setItem(`tokenwire:session_token:${server.url}:inflight`, "{not json");
  assert.deepEqual(await c.restore(), []);
});

test("the React Native, NetInfo, MMKV and browser adapters", () => {
  const calls = [];
  const fakeClient = {
    pause: (o) => calls.push(["pause", o?.graceMs]),
    resume: () => calls.push(["resume"]),
    setOnline: (v) => calls.push(["online", v]),
  };
  let appListener = null;
  let removed = 0;
  const AppState = { addEventListener: (ev, fn) => ((appListener = fn), { remove: () => (removed += 1) }) };
  const offApp = withAppState(fakeClient, AppState, { graceMs: 1234 });
  appListener("background");
  appListener("inactive");
  appListener("active");
  offApp();
  let netListener = null;
  const NetInfo = { addEventListener: (fn) => ((netListener = fn), () => (removed += 1)) };
  const offNet = withNetInfo(fakeClient, NetInfo);
  netListener({ isConnected: false, isInternetReachable: null });
  netListener({ isConnected: true, isInternetReachable: null });
  netListener({ isConnected: true, isInternetReachable: false });
  offNet();
  const target = () => {
    const fns = new Map();
    return { fns, addEventListener: (e, f) => fns.set(e, f), removeEventListener: (e) => fns.delete(e) };
  };
  const w = target();
  const d = { ...target(), visibilityState: "visible" };
  const offBrowser = withBrowserLifecycle(fakeClient, { window: w, document: d });
  d.visibilityState = "hidden";
  d.fns.get("visibilitychange")();
  w.fns.get("offline")();
  w.fns.get("online")();
  d.visibilityState = "visible";
  d.fns.get("visibilitychange")();
  offBrowser();
  assert.equal(w.fns.size + d.fns.size, 0);
  assert.equal(removed, 2);
  assert.deepEqual(calls, [
    ["pause", 1234], ["resume"],
    ["online", false], ["online", true], ["online", false],
    ["pause", undefined], ["online", false], ["online", true], ["resume"],
  ]);
  const mem = new Map();
  const kv = mmkvStorage({ getString: (k) => mem.get(k), set: (k, v) => mem.set(k, v), delete: (k) => mem.delete(k) });
  assert.equal(kv.getItem("a"), null);
  kv.setItem("a", 5);
  assert.equal(kv.getItem("a"), "5");
  kv.removeItem("a");
  assert.equal(kv.getItem("a"), null);
});

test("Stop of a restored reply before the new client is connected reaches the server", async () => {
  // The mobile scenario found it: a restored request was taken for one the server never saw, so Stop
  // ended it on the phone only, and the server generated on.
  const server = await fake({ holdAt: () => 6 });
  const storage = new MemoryStorage();
  const a = client(server.url, { storage, persist: storage });
  await a.connect();
  const first = a.chat("hi", {}, { id: "r4" });
  await until(() => first.offset === 6, "6 tokens");
  a.close();
  const b = client(server.url, { storage, persist: storage });
  const [{ stream }] = await b.restore();
  b.cancel("r4"); // before the welcome
  const done = await drain(stream);
  assert.equal(done.finishReason, "cancelled");
  assert.equal(done.offset, 6);
  assert.equal(server.received.filter((f) => f.type === "cancel").length, 1);
});

// ---- found by an outside probe of the client's mobile life (2026-12-06) ----------------------------

class ThrowingStorage extends MemoryStorage {
  setItem(key, value) {
    if (key.endsWith(":inflight")) throw new Error("QuotaExceededError"); // what localStorage does when full
    return super.setItem(key, value);
  }
}

test("a persist storage that throws at once is reported as an error; pause and close still work", async () => {
  const server = await fake({ holdAt: () => 5 });
  const storage = new ThrowingStorage();
  const c = client(server.url, { storage, persist: storage });
  const errors = [];
  c.on("error", (e) => errors.push(e));
  await c.connect();
  const stream = c.chat("hi", {}, { id: "q1" });
  await until(() => stream.offset === 5, "5 tokens");
  await new Promise((r) => setTimeout(r, 300)); // the throttled write after the deltas
  assert.ok(errors.length >= 1 && errors.every((e) => /Quota/.test(e.message)), String(errors));
  assert.doesNotThrow(() => c.pause({ graceMs: 20 }));
  await until(() => c.state === "paused", "paused after the grace");
  assert.doesNotThrow(() => c.close());
  assert.equal(c.state, "closed");
  server.release("q1"); // the fake server's held stream would otherwise keep this file's process alive
});

test("restore yields the saved text first, and sends again a chat the server had not accepted", async () => {
  const server = await fake({ holdAt: (f) => (f.id === "s1" ? 7 : null), overload: 0 });
  const storage = new MemoryStorage();
  const a = client(server.url, { storage, persist: storage });
  await a.connect();
  const inflight = `tokenwire:session_token:${server.url}:inflight`;
  const s1 = a.chat("hi", {}, { id: "s1" });
  // Saved from its accepted on, before any delta's throttled write.
  await until(() => JSON.parse(storage.getItem(inflight) ?? "{}").s1 !== undefined, "s1 saved");
  await until(() => s1.offset === 7 && JSON.parse(storage.getItem(inflight)).s1.offset === 7, "offset 7 saved");
  // The network goes; a chat sent then is never accepted, so it is kept as its frame.
  a.setOnline(false);
  a.reconnectNow("network gone");
  await until(() => a.state === "offline", "offline");
  a.chat("later", { max_tokens: 9, temperature: 0.5 }, { id: "s2" });
  assert.deepEqual(JSON.parse(storage.getItem(inflight)).s2, {
    chat: { type: "chat", id: "s2", content: "later", params: { max_tokens: 9, temperature: 0.5 } },
  });
  a.close(); // the app is killed
  server.release("s1");
  const b = client(server.url, { storage, persist: storage });
  const restored = await b.restore();
  assert.deepEqual(restored.map((r) => r.id).sort(), ["s1", "s2"]);
  const byId = Object.fromEntries(restored.map((r) => [r.id, r.stream]));
  const items = [];
  for await (const item of byId.s1) items.push(item);
  // The first item is the saved text, [0, 7); the rest continue from 7: the loop shows it whole.
  assert.deepEqual(items[0], { type: "delta", id: "s1", offset: 0, n: 7, text: TOKENS.slice(0, 7).join("") });
  assert.equal(items[1].offset, 7);
  assert.equal(items.map((i) => i.text).join(""), FULL);
  const done2 = await drain(byId.s2);
  assert.equal(done2.text, FULL);
  const resent = server.received.filter((f) => f.type === "chat" && f.id === "s2");
  assert.equal(resent.length, 1);
  assert.deepEqual(resent[0].params, { max_tokens: 9, temperature: 0.5 });
  await until(() => storage.getItem(inflight) === null, "cleared once both are done");
});

test("a chat frame over the server's limit fails alone; the other chats go on", async () => {
  const server = await fake();
  const c = client(server.url, { subprotocols: ["json"] });
  await c.connect();
  // Past the limit by its text alone: refused before anything is tracked or sent.
  assert.throws(() => c.chat("x".repeat(1048577), {}, { id: "big1" }), (e) => e.code === "too_large");
  assert.deepEqual(c.pending, []);
  // Under it as text, over it as JSON (every quote is escaped): refused when encoded, that stream only.
  const big = c.chat('"'.repeat(600000), {}, { id: "big2" });
  const small = c.chat("hi", {}, { id: "small" });
  await assert.rejects(big.result, (e) => e.code === "too_large" && e.id === "big2");
  assert.equal((await small.result).text, FULL);
  assert.equal(server.received.filter((f) => f.type === "chat" && f.id.startsWith("big")).length, 0);
  assert.equal(server.connections, 1); // no 1009, no reconnect
});

test("cancelling a chat that waits to be retried after overloaded ends it cancelled", async () => {
  const server = await fake({ overload: 1 });
  const c = client(server.url);
  await c.connect();
  const stream = c.chat("hi", {}, { id: "ov1" });
  await until(() => server.received.some((f) => f.type === "chat" && f.id === "ov1"), "the chat refused once");
  await new Promise((r) => setTimeout(r, 20)); // its overloaded is in; the retry is 100 ms away
  c.cancel("ov1");
  const done = await stream.result;
  assert.equal(done.finishReason, "cancelled");
  await new Promise((r) => setTimeout(r, 200));
  assert.equal(server.received.filter((f) => f.type === "chat" && f.id === "ov1").length, 1); // not retried
});

test("text with a lone UTF-16 surrogate is refused before anything is sent", () => {
  const c = client("ws://127.0.0.1:9/v1/ws", { autoConnect: false });
  const half = "hi \ud83d there"; // an emoji cut in half
  assert.throws(() => c.chat(half), RangeError);
  assert.throws(() => c.chat([{ role: "user", content: "ok" }, { role: "user", content: "\udc00" }]), RangeError);
  assert.throws(() => c.chat("ok", { stop: ["\ud800"] }), RangeError);
  assert.doesNotThrow(() => c.chat("a whole emoji \ud83d\ude00"));
  c.close();
});
