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
