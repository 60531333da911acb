// The React Native example's logic (examples/react-native/chat-controller.js) with React Native's modules
// replaced by small fakes, against the fake server: the app backgrounded and foregrounded mid-reply, the
// network lost and back, Stop after a reconnect, and the app killed and relaunched with its AsyncStorage.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import WebSocket from "ws";

import { createChatController } from "../examples/react-native/chat-controller.js";
import * as tokenwire from "../src/index.js";
import { FakeServer } from "../testing/fake-server.js";

const TOKENS = Array.from({ length: 24 }, (_, i) => `w${i} `);
const servers = [];
const controllers = [];

after(async () => {
  for (const c of controllers) c.dispose();
  for (const s of servers) await s.close();
});

/** AsyncStorage's shape: every method returns a promise. */
class FakeAsyncStorage {
  items = new Map();
  async getItem(k) {
    return this.items.has(k) ? this.items.get(k) : null;
  }
  async setItem(k, v) {
    this.items.set(k, String(v));
  }
  async removeItem(k) {
    this.items.delete(k);
  }
}

class FakeAppState {
  listeners = new Set();
  addEventListener(type, fn) {
    this.listeners.add(fn);
    return { remove: () => this.listeners.delete(fn) };
  }
  set(state) {
    for (const fn of this.listeners) fn(state);
  }
}

class FakeNetInfo {
  listeners = new Set();
  addEventListener(fn) {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }
  set(isConnected) {
    for (const fn of this.listeners) fn({ isConnected, isInternetReachable: isConnected ? true : false });
  }
}

async function until(cond, what, ms = 10000) {
  const deadline = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`timed out: ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

function app(server, AsyncStorage) {
  const env = { AppState: new FakeAppState(), NetInfo: new FakeNetInfo(), AsyncStorage, views: [] };
  env.chat = createChatController({
    tokenwire,
    url: server.url,
    WebSocket,
    AppState: env.AppState,
    NetInfo: env.NetInfo,
    AsyncStorage,
    graceMs: 0,
    onChange: (v) => env.views.push(v),
  });
  controllers.push(env.chat);
  env.last = () => env.views.at(-1);
  env.reply = () => env.last()?.messages.at(-1);
  return env;
}

test("backgrounded and foregrounded mid-reply, then the network lost and back: the whole reply once", async () => {
  const server = await new FakeServer({ reply: () => TOKENS, delayMs: 10, holdAt: () => 6 }).start();
  servers.push(server);
  const a = app(server, new FakeAsyncStorage());
  await a.chat.start();
  const sent = a.chat.send("hello");
  await until(() => a.reply()?.text === TOKENS.slice(0, 6).join(""), "6 tokens shown");
  a.AppState.set("background");
  await until(() => a.chat.client.state === "paused", "paused");
  a.AppState.set("active");
  await until(() => a.chat.client.state === "open", "back");
  a.NetInfo.set(false);
  server.dropAll();
  await until(() => a.chat.client.state === "offline", "offline");
  server.release(server.received.find((f) => f.type === "chat").id);
  a.NetInfo.set(true);
  await sent;
  assert.equal(a.reply().text, TOKENS.join(""));
  assert.equal(a.reply().finish, "stop");
  assert.ok(!server.received.some((f) => f.type === "cancel"));
});

test("Stop after a reconnect ends the reply as stopped", async () => {
  const server = await new FakeServer({ reply: () => TOKENS, delayMs: 10, holdAt: () => 3 }).start();
  servers.push(server);
  const a = app(server, new FakeAsyncStorage());
  await a.chat.start();
  const sent = a.chat.send("hello");
  await until(() => a.reply()?.text === TOKENS.slice(0, 3).join(""), "3 tokens shown");
  server.dropAll(); // a network switch
  await until(() => server.connections === 2 && a.chat.client.state === "open", "reconnected");
  a.chat.stop();
  await sent;
  assert.equal(a.reply().finish, "cancelled");
  assert.equal(a.reply().cancelReason, null); // the user's Stop: shown as stopped
});

test("killed mid-reply and relaunched: the reply is shown at once and completed", async () => {
  const server = await new FakeServer({ reply: () => TOKENS, delayMs: 10, holdAt: () => 8 }).start();
  servers.push(server);
  const storage = new FakeAsyncStorage();
  const a = app(server, storage);
  await a.chat.start();
  a.chat.send("hello");
  await until(() => a.reply()?.text === TOKENS.slice(0, 8).join(""), "8 tokens shown");
  await until(() => [...storage.items.keys()].some((k) => k.endsWith(":inflight") && storage.items.get(k).includes('"offset":8')), "persisted");
  a.chat.dispose(); // the OS kills the app
  const id = server.received.find((f) => f.type === "chat").id;
  server.release(id);
  const b = app(server, storage); // relaunched with the same storage
  await b.chat.start();
  assert.equal(b.last().messages[0].text, TOKENS.slice(0, 8).join("")); // at once, from storage
  await until(() => b.reply()?.finish === "stop", "completed");
  assert.equal(b.reply().text, TOKENS.join(""));
  await until(() => ![...storage.items.keys()].some((k) => k.endsWith(":inflight")), "cleared");
});

test("away longer than the server's detach timeout: the reply ends interrupted, not stopped", async () => {
  const server = await new FakeServer({ reply: () => TOKENS, delayMs: 10, holdAt: () => 5 }).start();
  servers.push(server);
  const a = app(server, new FakeAsyncStorage());
  await a.chat.start();
  const sent = a.chat.send("hello");
  await until(() => a.reply()?.text === TOKENS.slice(0, 5).join(""), "5 tokens shown");
  const chat = server.received.find((f) => f.type === "chat");
  assert.equal(chat.params.detach_timeout_ms, 600000); // the example asks for 10 minutes
  a.AppState.set("background");
  await until(() => a.chat.client.state === "paused", "paused");
  server.detachTimeout(chat.id); // nobody attached for the detach timeout
  a.AppState.set("active");
  await sent;
  assert.equal(a.reply().finish, "cancelled");
  assert.equal(a.reply().cancelReason, "detach_timeout");
  assert.equal(a.reply().text, TOKENS.slice(0, 5).join(""));
});
