// A small server that speaks protocol v1 (hello → welcome; chat → accepted, deltas, done; resume with
// epochs; cancel; ping → pong) over either subprotocol, streaming replies the test scripts. For what
// the real server with the tiny model cannot be made to do on demand: say a given string (the XSS test),
// restart a log under a new epoch, answer overloaded, refuse a stale session token.
import { WebSocketServer } from "ws";
import * as msgpack from "@msgpack/msgpack";

import { createCodecWith } from "../src/core.js";

export class FakeServer {
  /**
   * `reply(frame)` gives the list of delta texts for a chat (one token each). Options: `delayMs`
   * between deltas; `overload` (how many chats to refuse with `overloaded` first); `validToken`
   * (a hello with another session_token is refused: unauthorized, close 1008); `holdAt(frame)`: a
   * token count after which that chat's stream waits until release(id) or a cancel (null: never), so a
   * reply that must still be streaming when the test acts cannot finish first; `finish(frame)`: the
   * finish_reason of a reply that runs out of tokens (default "stop"); `lengthReason(frame)`: the
   * length_reason sent with that end (default none, as from a server before it), whatever its finish,
   * so a test can also send a bad one.
   */
  constructor({ reply, delayMs = 20, overload = 0, validToken = null, holdAt = () => null, finish = () => "stop", lengthReason = () => undefined }) {
    this.reply = reply;
    this.holdAt = holdAt;
    this.finish = finish;
    this.lengthReason = lengthReason;
    this.connections = 0;
    this.delayMs = delayMs;
    this.overload = overload;
    this.validToken = validToken;
    this.models = null; // set to an array: welcome lists these models and accepted names the chat's
    this.maxTokens = 8192; // welcome.limits.max_tokens: the most tokens a reply may have here
    this.requests = new Map(); // id -> {texts, epoch, hold, cancelled, sent}
    this.received = [];
    this.sockets = new Set();
  }

  async start() {
    this.wss = new WebSocketServer({
      host: "127.0.0.1",
      port: 0,
      handleProtocols: (protocols) => ["tokenwire.v1.msgpack", "tokenwire.v1.json"].find((p) => protocols.has(p)) ?? false,
    });
    await new Promise((resolve) => this.wss.on("listening", resolve));
    this.url = `ws://127.0.0.1:${this.wss.address().port}/v1/ws`;
    this.wss.on("connection", (ws) => this.#connection(ws));
    return this;
  }

  /** Stop streaming request `id` after `n` tokens until release(id). */
  hold(id, n) {
    this.#req(id).hold = n;
  }

  release(id) {
    this.#req(id).hold = null;
  }

  /** End request `id` as the detach timeout does (nobody attached for it): done cancelled, cancel_reason. */
  detachTimeout(id) {
    const r = this.#req(id);
    if (r.cancelled == null) r.cancelled = r.sent;
    r.cancelReason = "detach_timeout";
  }

  /** The log of `id` is lost and regenerated: a new epoch with other text. */
  restartLog(id, texts) {
    const r = this.#req(id);
    r.epoch += 1;
    r.texts = texts;
  }

  /** Kill every connection without a close frame (the network dropped). */
  dropAll() {
    for (const ws of this.sockets) ws.terminate();
  }

  #req(id) {
    if (!this.requests.has(id)) this.requests.set(id, { texts: null, epoch: 1, hold: null, cancelled: null, sent: 0 });
    return this.requests.get(id);
  }

  #connection(ws) {
    this.connections += 1;
    this.sockets.add(ws);
    ws.on("close", () => this.sockets.delete(ws));
    const codec = createCodecWith(ws.protocol, msgpack);
    const send = (f) => {
      if (ws.readyState !== ws.OPEN) return false;
      ws.send(codec.encode(f));
      return true;
    };
    let hello = false;
    ws.on("message", (data, isBinary) => {
      const f = codec.decode(isBinary ? new Uint8Array(data) : data.toString("utf8"));
      this.received.push(f);
      if (!hello) {
        if (f.type !== "hello") return send({ type: "error", code: "bad_frame", message: "hello first" });
        if (this.validToken && f.session_token && f.session_token !== this.validToken) {
          send({ type: "error", code: "unauthorized", message: "session token not issued here" });
          return ws.close(1008, "unauthorized");
        }
        hello = true;
        const welcome = { type: "welcome", v: 1, session: "fake", session_token: this.validToken ?? "fake.token", server: "fake", limits: { max_frame_bytes: 1048576, max_tokens: this.maxTokens } };
        if (this.models) welcome.models = this.models;
        send(welcome);
        for (const p of f.resume ?? []) this.#resume(send, p);
        return;
      }
      if (f.type === "chat") {
        if (this.overload > 0) {
          this.overload -= 1;
          return send({ type: "error", id: f.id, code: "overloaded", message: "queue full", retry_after_ms: 100 });
        }
        const r = this.#req(f.id);
        if (r.texts === null) {
          if (this.models) r.model = f.params?.model ?? this.models[0];
          r.texts = this.reply(f);
          r.hold = this.holdAt(f);
          r.finish = this.finish(f);
          r.lengthReason = this.lengthReason(f);
        }
        this.#stream(send, f.id, 0);
      } else if (f.type === "resume") this.#resume(send, f);
      else if (f.type === "cancel") {
        const r = this.requests.get(f.id);
        if (!r) send({ type: "error", id: f.id, code: "not_found", message: "no such request" });
        else if (r.cancelled == null) r.cancelled = r.sent;
      } else if (f.type === "ping") send(f.ts == null ? { type: "pong" } : { type: "pong", ts: f.ts });
    });
  }

  #resume(send, { id, offset, epoch }) {
    const r = this.requests.get(id);
    if (!r) return send({ type: "error", id, code: "not_found", message: "no such request" });
    if (epoch != null && offset > 0 && epoch !== r.epoch) {
      return send({ type: "error", id, code: "resume_failed", message: "the log restarted under a new epoch" });
    }
    this.#stream(send, id, offset);
  }

  async #stream(send, id, offset) {
    const r = this.requests.get(id);
    send({ type: "accepted", id, epoch: r.epoch, state: "running", ...(r.model ? { model: r.model } : {}) });
    const epoch = r.epoch;
    let i = offset;
    const end = () => (r.cancelled != null ? r.cancelled : r.texts.length);
    while (i < end()) {
      await new Promise((resolve) => setTimeout(resolve, this.delayMs));
      if (r.epoch !== epoch) return; // this stream's log is gone
      if (r.hold != null && i >= r.hold) continue;
      if (i >= end()) break;
      if (!send({ type: "delta", id, offset: i, n: 1, text: r.texts[i] })) return;
      i += 1;
      r.sent = Math.max(r.sent, i);
    }
    const reason = r.cancelled != null ? "cancelled" : (r.finish ?? "stop");
    const why = reason === "cancelled" && r.cancelReason ? { cancel_reason: r.cancelReason } : {};
    if (r.cancelled == null && r.lengthReason !== undefined) why.length_reason = r.lengthReason;
    send({ type: "done", id, finish_reason: reason, offset: i, usage: { prompt_tokens: 3, completion_tokens: i }, ...why });
  }

  async close() {
    for (const c of this.wss.clients) c.terminate();
    await new Promise((resolve) => this.wss.close(resolve));
  }
}
