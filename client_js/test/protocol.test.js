// What the real server does only in rare failures, scripted with a fake protocol server: a log that
// restarted under a new epoch (SPEC §10.4: never join text from two epochs), an `overloaded` answer
// (retry the same chat after retry_after_ms), and a stored session token the server refuses (start a
// new session instead of giving up).
import assert from "node:assert/strict";
import { after, test } from "node:test";

import WebSocket from "ws";

import { MemoryStorage, TokenwireClient } from "../src/index.js";
import { FakeServer } from "../testing/fake-server.js";

const cleanup = [];
after(async () => {
  for (const fn of cleanup.reverse()) await fn();
});

async function fake(options) {
  const server = await new FakeServer(options).start();
  cleanup.push(() => server.close());
  return server;
}

function client(url, options = {}) {
  const c = new TokenwireClient(url, { WebSocket, storage: new MemoryStorage(), backoff: { initialMs: 20, maxMs: 100 }, ...options });
  c.states = [];
  c.on("state", (e) => c.states.push(e.state));
  cleanup.push(() => c.close());
  return c;
}

test("a log restarted under a new epoch: the client discards its text (reset) and replays the new log", async () => {
  const server = await fake({ reply: () => ["a", "b", "c", "d"], delayMs: 5 });
  const c = client(server.url);
  const stream = c.chat("hi", {}, { id: "r1" });
  server.hold("r1", 2);
  const items = [];
  const resumes = [];
  c.on("resume", (e) => resumes.push(e.points));
  for await (const item of stream) {
    items.push(item);
    if (items.length === 2) {
      server.restartLog("r1", ["x", "y", "z"]);
      server.release("r1");
      server.dropAll();
    }
  }
  const result = await stream.result;
  assert.deepEqual(resumes[0], [{ id: "r1", offset: 2, epoch: 1 }], "the resume point carries the epoch held");
  assert.deepEqual(
    items.map((i) => (i.type === "delta" ? i.text : `<${i.type}:${i.reason}>`)),
    ["a", "b", "<reset:resume_failed>", "x", "y", "z"],
  );
  assert.equal(result.text, "xyz", "no text from the old epoch");
  assert.equal(result.epoch, 2);
  assert.equal(result.offset, 3);
  // After resume_failed it asked for the new log from 0 (no epoch: it holds nothing now).
  assert.deepEqual(server.received.filter((f) => f.type === "resume"), [{ type: "resume", id: "r1", offset: 0 }]);
});

test("overloaded: the same chat (same id) is sent again after retry_after_ms", async () => {
  const server = await fake({ reply: () => ["o", "k"], delayMs: 1, overload: 1 });
  const c = client(server.url);
  const t0 = Date.now();
  const result = await c.chat("hi", { max_tokens: 5 }).result;
  assert.equal(result.text, "ok");
  // The fake server predates usage.cached_tokens (SPEC §4): it reads as 0.
  assert.deepEqual(result.usage, { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 0 });
  const chats = server.received.filter((f) => f.type === "chat");
  assert.equal(chats.length, 2);
  assert.deepEqual(chats[1], chats[0]);
  assert.ok(Date.now() - t0 >= 100, "waited retry_after_ms");
});

test("a stored session token the server refuses: one retry without it, a new session, stored", async () => {
  const server = await fake({ reply: () => ["n", "e", "w"], delayMs: 1, validToken: "good.token" });
  const storage = new MemoryStorage();
  storage.setItem("k", "stale.token");
  const c = client(server.url, { storage, storageKey: "k" });
  const result = await c.chat("hi").result;
  assert.equal(result.text, "new");
  const hellos = server.received.filter((f) => f.type === "hello");
  assert.equal(hellos[0].session_token, "stale.token");
  assert.equal(hellos[1].session_token, undefined);
  assert.equal(storage.getItem("k"), "good.token");
  assert.ok(!c.states.includes("closed"));
});

test("cancel while disconnected is delivered after the reconnect", async () => {
  const server = await fake({ reply: () => Array.from({ length: 50 }, (_, i) => `${i} `), delayMs: 5 });
  const c = client(server.url);
  const stream = c.chat("hi", {}, { id: "r2" });
  server.hold("r2", 3);
  for await (const item of stream) {
    if (item.offset === 2) {
      server.dropAll();
      await c.once("reconnecting");
      c.cancel("r2"); // while no connection is open
      server.release("r2");
    }
  }
  const result = await stream.result;
  assert.equal(result.finishReason, "cancelled");
  assert.ok(result.offset < 50);
  const sent = server.received.filter((f) => f.type !== "ping").map((f) => f.type);
  assert.deepEqual(sent.slice(-2), ["hello", "cancel"], "hello (with the resume point), then the cancel");
});

test("params.model is sent and accepted.model is the stream's model; a bad model is refused before sending", async () => {
  const server = await fake({ reply: () => ["hi"], delayMs: 1 });
  server.models = ["big", "light"];
  const c = client(server.url);
  const welcome = await c.connect();
  assert.deepEqual(welcome.models, ["big", "light"]);
  const stream = c.chat("hello", { model: "light", fallback: false });
  await stream.result;
  assert.equal(stream.model, "light");
  const sent = server.received.find((f) => f.type === "chat");
  assert.deepEqual(sent.params, { model: "light", fallback: false });
  assert.throws(() => c.chat("hello", { model: "" }), /params.model/);
  assert.throws(() => c.chat("hello", { fallback: "no" }), /params.fallback/);
});
