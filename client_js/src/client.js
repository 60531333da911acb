// TokenwireClient: one WebSocket that reconnects by itself and resumes every request where it left off
// (SPEC §10): nothing lost, nothing repeated, nothing generated twice.
//
// Per request the client keeps the id, the payload (to retry a chat that was never accepted with the
// same id), the epoch from `accepted`, the text received and the next offset. After a drop it
// reconnects with exponential backoff and full jitter, sends `hello` with the stored session token and a
// resume point {id, offset, epoch} for every request that had been accepted, and resends the chats that
// had not. Application pings find connections that died silently (a phone switching networks).

import { SUBPROTOCOLS, MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL, CodecError, WireFloat, createCodec } from "./codec.js";
import { Emitter } from "./emitter.js";
import * as F from "./frames.js";
import { defaultStorage } from "./storage.js";

export const STATES = Object.freeze(["idle", "connecting", "open", "reconnecting", "paused", "offline", "closed"]);
// Requests kept in `persist` storage for a relaunch: at most this many (the newest), all in one stored
// value of at most MAX_PERSISTED_BYTES of UTF-8. That bound keeps the value under the 64 KiB some stores
// cap an entry at, so one long reply never stops the others being saved: over it, the longest saved texts
// go first (such a reply keeps its id only, and is replayed whole from the server on restore).
export const MAX_PERSISTED = 32;
export const MAX_PERSISTED_BYTES = 60 * 1024;
// No longer a bound of its own (every text that fits in MAX_PERSISTED_BYTES is shorter); kept for imports.
export const MAX_PERSISTED_TEXT = 64 * 1024;
const NO_TEXT = Object.freeze({ offset: 0, epoch: null, text: "" }); // a reply saved without its text
const PERSIST_EVERY_MS = 250;

const FATAL_CLOSE_CODES = new Set([1002, 1008]);
// The end of a request cancelled before the server took it (never sent, or refused for now): nothing
// ran, so nothing was generated.
const CANCELLED_UNSENT = Object.freeze({
  finish_reason: "cancelled",
  offset: 0,
  usage: Object.freeze({ prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 }),
});
// SPEC §2.2: the largest message the server reads, when its welcome has not said (limits.max_frame_bytes).
export const DEFAULT_MAX_FRAME_BYTES = 1048576;
const MAX_RESETS = 5;

/** An error from the server (its `code` is one of SPEC §6) or from the client itself. */
export class TokenwireError extends Error {
  constructor(code, message, details = {}) {
    super(`${code}: ${message}`);
    this.name = "TokenwireError";
    this.code = code;
    this.id = details.id;
    this.retryAfterMs = details.retryAfterMs;
    this.done = details.done;
  }

  static fromFrame(f, done) {
    return new TokenwireError(f.code, f.message ?? "", { id: f.id, retryAfterMs: f.retry_after_ms, done });
  }
}

/** Delay before reconnect attempt `attempt` (0-based): uniform in [0, min(max, initial * 2^attempt)]. */
export function backoffDelay(attempt, { initialMs = 300, maxMs = 10000, random = Math.random } = {}) {
  const cap = Math.min(maxMs, initialMs * 2 ** Math.min(attempt, 30));
  return Math.floor(random() * cap);
}

/**
 * Milliseconds on a clock that never jumps (performance.now: browsers, Node, React Native): the heartbeat,
 * the ping's round trip and the backoff's "stable" measure spans of time, which a wall clock set back an
 * hour (Date.now) would stretch by that hour, silencing the dead-link detection until then.
 */
function monotonicMs() {
  return globalThis.performance?.now?.() ?? Date.now();
}

// A connection that stayed up this long was a success: the backoff starts again from its first step. One
// that is dropped sooner (a server that welcomes and then closes, a flapping proxy) is a failed attempt,
// and the next delay grows, or every client would reconnect within 300 ms, in a loop, all at once.
const STABLE_MS = 10000;

/** A random request id (32 hex digits); crypto.getRandomValues works in insecure contexts too. */
export function newId() {
  const b = new Uint8Array(16);
  globalThis.crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

function subprotocolsFrom(option, hasMsgpack) {
  const names = (option ?? ["msgpack", "json"]).map((p) =>
    p === "msgpack" ? MSGPACK_SUBPROTOCOL : p === "json" ? JSON_SUBPROTOCOL : p,
  );
  for (const n of names) if (!SUBPROTOCOLS.includes(n)) throw new TypeError(`unknown subprotocol ${n}`);
  // Without a msgpack implementation the JSON subprotocol is the only one this client can speak.
  const usable = hasMsgpack ? names : names.filter((n) => n === JSON_SUBPROTOCOL);
  if (!usable.length) throw new TypeError("no usable subprotocol: pass the msgpack module or allow json");
  return usable;
}

function resolveUrl(url) {
  const s = String(url);
  if (/^wss?:\/\//i.test(s)) return s;
  const loc = globalThis.location;
  if (loc && loc.href) {
    const u = new URL(s, loc.href);
    u.protocol = u.protocol === "https:" ? "wss:" : "ws:";
    return u.href;
  }
  throw new TypeError(`not a ws:// or wss:// URL: ${s}`);
}

/**
 * The stream of one request. Async-iterable: yields `{type: "delta", id, offset, n, text}` items, and
 * `{type: "reset", id, reason}` when the text received so far must be thrown away (the server's log
 * restarted under a new epoch, SPEC §10.4); ends after `done`, throwing a TokenwireError if the request
 * failed. `result` resolves with `{id, text, finishReason, offset, usage, epoch}`.
 */
export class ChatStream {
  #client;
  #items = [];
  #wake = null;
  #ended = false;
  #error = null;
  #iterating = false;
  #resolve;
  #reject;

  constructor(client, id) {
    this.#client = client;
    this.id = id;
    this.text = "";
    this.offset = 0;
    this.epoch = null;
    this.model = null; // the model that serves it, from accepted.model (null: the server did not say)
    // pending | waiting | queued | running | done | failed | cancelled (server's view). "waiting": a
    // content-mode turn the server holds until the session's previous turn ends (SPEC §4.2);
    // `waitingFor` then names that turn when the server said.
    this.state = "pending";
    this.waitingFor = null;
    this.finishReason = null;
    // "detach_timeout": the server cancelled it because nobody was attached for its detach timeout (the
    // app was away too long), not because of a cancel. null otherwise.
    this.cancelReason = null;
    // With finishReason "length": the limit that ended it, "max_tokens" (as asked, or as lowered by a
    // busy server) or "context" (the model's context window is full: more tokens would not help). null
    // otherwise, and when the server did not say (SPEC §12).
    this.lengthReason = null;
    this.result = new Promise((resolve, reject) => {
      this.#resolve = resolve;
      this.#reject = reject;
    });
    // Callers that only iterate must not get an unhandled rejection from `result`.
    this.result.catch(() => {});
  }

  /** Ask the server to stop this request (the stream then ends with finishReason "cancelled"). */
  cancel() {
    this.#client.cancel(this.id);
  }

  _push(item) {
    if (item.type === "delta") {
      this.text += item.text;
      this.offset = item.offset + item.n;
    } else if (item.type === "reset") {
      this.text = "";
      this.offset = 0;
    }
    this.#items.push(item);
    this.#notify();
  }

  /** Queue an item for the iterator without adding to `text` (which already holds it): restore(). */
  _prime(item) {
    this.#items.push(item);
    this.#notify();
  }

  _finish(done, error) {
    if (this.#ended) return;
    this.#ended = true;
    this.finishReason = done ? done.finish_reason : null;
    // SPEC §10.5: any other cancel_reason is read as a plain cancel's.
    if (done?.finish_reason === "cancelled" && done.cancel_reason === "detach_timeout") this.cancelReason = "detach_timeout";
    // SPEC §12: a server before length_reason sends none, and a value this client does not know reads
    // the same: either limit.
    if (done?.finish_reason === "length" && F.LENGTH_REASONS.includes(done.length_reason)) this.lengthReason = done.length_reason;
    if (error) {
      this.#error = error;
      this.state = "failed";
      this.#reject(error);
    } else {
      this.state = done.finish_reason === "cancelled" ? "cancelled" : "done";
      this.#resolve({
        id: this.id,
        text: this.text,
        finishReason: done.finish_reason,
        cancelReason: this.cancelReason,
        lengthReason: this.lengthReason,
        offset: done.offset,
        // SPEC §4: a server before cached_tokens sends none; it reads as 0.
        usage: { ...done.usage, cached_tokens: done.usage.cached_tokens ?? 0 },
        epoch: this.epoch,
      });
    }
    this.#notify();
  }

  get ended() {
    return this.#ended;
  }

  #notify() {
    const w = this.#wake;
    this.#wake = null;
    if (w) w();
  }

  async *[Symbol.asyncIterator]() {
    if (this.#iterating) throw new TypeError("a ChatStream can be iterated only once");
    this.#iterating = true;
    for (;;) {
      if (this.#items.length) {
        yield this.#items.shift();
        continue;
      }
      if (this.#ended) break;
      await new Promise((resolve) => (this.#wake = resolve));
    }
    if (this.#error) throw this.#error;
  }
}

export class TokenwireClient extends Emitter {
  #url;
  #opts;
  #WebSocket;
  #msgpack;
  #subprotocols;
  #storage;
  #storageKey;
  #conn = null; // the current connection attempt or open connection
  #state = "idle";
  #attempt = 0; // consecutive failed attempts, for the backoff
  #everOpen = false;
  #retryTimer = null;
  #sessionToken = null;
  #tokenLoaded = null;
  #requests = new Map(); // id -> request record, in creation order
  #pings = new Map(); // ts -> resolve
  #pingSeq = 0;
  #offNetwork = null;
  #paused = false; // pause(): the app is in the background; no reconnects until resume()
  #pauseTimer = null;
  #offline = false; // setOnline(false): no network; waiting, not retrying
  #persist = null; // options.persist: replies in flight, kept for a relaunch
  #persistKey;
  #persistTimer = null;
  // No write before restore() or the first chat(): until then the stored value is an earlier run's, which
  // pause(), close() or an ended resume(id) of this client must not erase.
  #persistArmed = false;
  // A storage whose writes return promises may finish them out of order: one write at a time, and after
  // it only the latest value (undefined: none waiting; null: remove), so the last to land is the latest.
  #persistWriting = false;
  #persistNext = undefined;

  /**
   * @param url ws:// or wss:// URL of /v1/ws (a path like "/v1/ws" is resolved against the page in browsers)
   * @param options see index.d.ts (token, storage, storageKey, subprotocols, WebSocket, msgpack,
   *   backoff, heartbeat, connectTimeoutMs, autoConnect, coalesceMs)
   */
  constructor(url, options = {}) {
    super();
    this.#url = typeof url === "function" ? url : resolveUrl(url);
    this.#opts = options;
    this.#WebSocket = options.WebSocket ?? globalThis.WebSocket;
    if (typeof this.#WebSocket !== "function") {
      throw new TypeError("no WebSocket implementation: pass options.WebSocket (e.g. the `ws` package in Node)");
    }
    this.#msgpack = options.msgpack ?? null;
    if (options.coalesceMs != null) F.hello({ coalesceMs: options.coalesceMs }); // checks the range now
    // A token string the hello would refuse would fail every attempt, for ever: refused now. (A token()
    // function is checked at each attempt: it may return a good one next time.)
    if (options.token != null && typeof options.token !== "function") F.hello({ token: options.token });
    checkDetachTimeout(options.detachTimeoutMs);
    this.#subprotocols = subprotocolsFrom(options.subprotocols, !!this.#msgpack);
    this.#storage = options.storage === undefined ? defaultStorage() : options.storage;
    this.#storageKey = options.storageKey ?? `tokenwire:session_token:${typeof url === "function" ? "default" : this.#url}`;
    this.#persist = options.persist ?? null;
    this.#persistKey = `${this.#storageKey}:inflight`;
    this.welcome = null;
    this.rttMs = null;
    if (options.autoConnect !== false) queueMicrotask(() => this.#state === "idle" && this.connect().catch(() => {}));
    this.#watchNetwork();
  }

  /** idle | connecting | open | reconnecting | closed */
  get state() {
    return this.#state;
  }

  get sessionToken() {
    return this.#sessionToken;
  }

  /** The subprotocol of the open connection (null when not open). */
  get subprotocol() {
    return this.#conn?.welcomed ? this.#conn.codec.subprotocol : null;
  }

  /** Ids of the requests that have not ended. */
  get pending() {
    return [...this.#requests.keys()];
  }

  /** Connect (or reconnect after close()); resolves once the server's welcome has arrived. */
  connect() {
    if (this.#state === "open") return Promise.resolve(this.welcome);
    const opened = new Promise((resolve, reject) => {
      const offOpen = this.on("open", () => {
        offOpen();
        offClosed();
        resolve(this.welcome);
      });
      const offClosed = this.on("closed", (ev) => {
        offOpen();
        offClosed();
        reject(ev.error ?? new TokenwireError("closed", "the client was closed"));
      });
    });
    if (this.#state === "idle" || this.#state === "closed") {
      this.#everOpen = false;
      this.#attempt = 0;
      if (!this.#offNetwork) this.#watchNetwork();
      this.#open();
    }
    return opened;
  }

  /**
   * Start a request. `input` is a string (content mode: one user turn appended to the session history)
   * or an array of {role, content} (messages mode). Returns a ChatStream; iterate it for the deltas.
   */
  chat(input, params = {}, { id = newId(), signal } = {}) {
    if (this.#state === "closed") throw new TokenwireError("closed", "the client is closed; call connect()");
    if (this.#requests.has(id)) throw new TypeError(`request ${id} is already in progress`);
    const detach = this.#opts.detachTimeoutMs;
    // The client's detachTimeoutMs, unless the chat names its own (anything but an object is left to
    // F.chat to refuse).
    if (detach != null && (params == null || (typeof params === "object" && !Array.isArray(params) && params.detach_timeout_ms == null))) {
      params = { ...params, detach_timeout_ms: detach };
    }
    const frame = F.chat(typeof input === "string" ? { id, content: input, params } : { id, messages: input, params });
    // A frame over the server's limit would close every connection it is sent on (1009), and with it
    // every other request's, again at each reconnect. Its text alone bounds its size from below (UTF-8
    // takes at least one byte per UTF-16 unit): past the limit, refused here; a frame whose encoding
    // only just passes it is refused when it is encoded (#drive).
    const units = frame.content != null ? frame.content.length : frame.messages.reduce((n, m) => n + m.content.length, 0);
    if (units > this.#maxFrameBytes()) {
      throw new TokenwireError("too_large", `the chat frame would exceed the server's ${this.#maxFrameBytes()} bytes (SPEC §2.2)`, { id });
    }
    const req = this.#track(id, frame, 0, null, "");
    if (signal) this.#bindSignal(req, signal); // before #drive, which may end it (#end unbinds)
    this.#drive(req);
    this.#persistArmed = true; // the app chose not to restore() first (README): this client's set is the one
    this.#flushPersisted(); // kept from the start: an app killed before its accepted sends it again
    return req.stream;
  }

  /**
   * Attach to an existing request of this owner (e.g. after a page reload): replays from `offset`
   * (0: the whole log), then streams live. Pass the `epoch` and `text` you hold for offset > 0.
   */
  resume(id, { offset = 0, epoch = null, text = "", signal } = {}) {
    if (id === undefined) return this.#foreground(); // the app lifecycle's resume(): see #foreground
    if (this.#state === "closed") throw new TokenwireError("closed", "the client is closed; call connect()");
    if (this.#requests.has(id)) return this.#requests.get(id).stream;
    // Checked now, as the hello or the resume frame would check them later, where a bad one cannot be
    // thrown to the caller (restore() skips an entry that fails here).
    F.resume({ id, offset, epoch: offset > 0 ? epoch : null });
    if (typeof text !== "string") throw new TypeError("text: expected a string");
    const req = this.#track(id, null, offset, epoch, text);
    req.accepted = true; // known to the server: resume, never re-chat
    if (signal) this.#bindSignal(req, signal); // before #drive, which may end it (#end unbinds)
    this.#drive(req);
    return req.stream;
  }

  /** Stop a request. Its stream ends with finishReason "cancelled" (once the server confirms). */
  cancel(id) {
    const req = this.#requests.get(id);
    if (req) {
      req.cancelRequested = true;
      if (!req.accepted && req.inDoubt === 0) {
        // The server holds nothing of it (never sent, or every send refused for now): nothing to stop
        // there, so it ends at once, also with no connection. (A request attached by resume() or
        // restore() is the server's even before this client sent anything: its cancel goes out with the
        // resume.)
        this.#end(req, CANCELLED_UNSENT);
        return;
      }
      this.#flushPersisted(); // the Stop is kept with it until the server confirms it (restore())
    }
    if (this.#conn?.welcomed) this.#send(F.cancel({ id }));
  }

  /** Round-trip time of an application ping, in ms (rejects if not connected). */
  ping() {
    if (!this.#conn?.welcomed) return Promise.reject(new TokenwireError("not_connected", "not connected"));
    const ts = ++this.#pingSeq;
    const start = monotonicMs();
    return new Promise((resolve, reject) => {
      this.#pings.set(ts, { ok: () => resolve(monotonicMs() - start), fail: reject });
      this.#send(F.ping(ts));
    });
  }

  /** Close for good (until connect()); unfinished streams fail with code "closed". */
  close() {
    if (this.#state === "closed") return;
    clearTimeout(this.#retryTimer);
    this.#retryTimer = null;
    clearTimeout(this.#pauseTimer);
    this.#pauseTimer = null;
    this.#flushPersisted();
    const conn = this.#conn;
    this.#conn = null;
    if (conn) this.#abandon(conn, 1000, "client closed");
    this.#offNetwork?.(); // the window's listeners would keep this client alive (connect() adds them again)
    this.#offNetwork = null;
    const err = new TokenwireError("closed", "the client was closed");
    for (const waiter of this.#pings.values()) waiter.fail(err);
    this.#pings.clear();
    for (const req of [...this.#requests.values()]) this.#end(req, null, err);
    this.#setState("closed", { error: err });
  }

  /** Forget the stored session token (the next connection starts a new session). */
  async forgetSession() {
    this.#sessionToken = null;
    if (this.#storage) await this.#storage.removeItem(this.#storageKey);
  }

  /** Close the current socket now, as if the network dropped, and reconnect (for tests and "retry now"). */
  reconnectNow(reason = "reconnect requested") {
    this.#attempt = 0; // asked for now: not the next step of the backoff of earlier failures
    const conn = this.#conn;
    if (conn) this.#lost(conn, { code: 4000, reason, abandon: true });
    else if (this.#state === "reconnecting") this.#retryNow();
  }

  /**
   * The app went to the background. After `graceMs` (default 5000) the socket is closed cleanly and no
   * reconnect is tried until resume(). This is never a cancel: the server runs every request on for its
   * detach timeout (30 s by default; options.detachTimeoutMs asks for longer), and resume() continues
   * each from its last offset. Persisted replies are saved now.
   */
  pause({ graceMs = 5000 } = {}) {
    if (this.#state === "closed" || this.#paused) return;
    this.#paused = true;
    this.#flushPersisted();
    clearTimeout(this.#pauseTimer);
    this.#pauseTimer = setTimeout(() => {
      this.#pauseTimer = null;
      if (!this.#paused) return;
      clearTimeout(this.#retryTimer);
      this.#retryTimer = null;
      const conn = this.#conn;
      this.#conn = null;
      if (conn) {
        // A clean close (1000), not an abort: the server sees the client go, and detaches its streams,
        // which run on (a disconnect never cancels).
        this.#abandon(conn, 1000, "paused", { clean: true });
        const err = new TokenwireError("not_connected", "paused");
        for (const waiter of this.#pings.values()) waiter.fail(err);
        this.#pings.clear();
      }
      for (const req of this.#requests.values()) {
        req.phase = "queued";
        req.conn = null;
        req.unanswered = false;
      }
      this.#setState("paused");
    }, graceMs);
  }

  /**
   * resume() without an id: foreground again. Reconnect now (no backoff) and resume every reply in
   * flight from its last offset; a socket that is still open is probed instead. setOnline(true) also
   * comes here, once it has ended the offline wait.
   */
  #foreground() {
    if (this.#state === "closed") return;
    const wasPaused = this.#paused;
    this.#paused = false;
    clearTimeout(this.#pauseTimer);
    this.#pauseTimer = null;
    if (this.#conn?.welcomed) {
      this.#probe(this.#conn);
      return;
    }
    if (this.#conn) return; // an attempt is under way
    if (this.#state === "idle" && !wasPaused) return; // never connected: connect() decides
    if (this.#offline) {
      // setOnline(false) still holds (the foreground is no news about the network): wait for
      // setOnline(true) instead of spinning the backoff.
      clearTimeout(this.#retryTimer);
      this.#retryTimer = null;
      this.#setState("offline");
      return;
    }
    this.#attempt = 0;
    this.#open();
  }

  /**
   * Tell the client whether the device has a network (NetInfo, the browser's online/offline). Offline,
   * a lost socket waits instead of spinning the backoff; online again, it reconnects at once.
   */
  setOnline(online) {
    if (online) {
      if (!this.#offline) return;
      this.#offline = false;
      if (!this.#paused) this.#foreground();
      return;
    }
    this.#offline = true;
    if (!this.#conn && this.#retryTimer) {
      clearTimeout(this.#retryTimer);
      this.#retryTimer = null;
      this.#setState("offline");
    }
  }

  /**
   * Replies that were in flight when the app last ran (kept by `options.persist`): each is resumed from
   * its saved offset, its stream starting with the saved text, so the app shows it whole with nothing
   * repeated. One that finished meanwhile replays the rest and ends. Returns [{id, stream}].
   */
  async restore() {
    const saved = await this.#readPersisted();
    this.#persistArmed = true;
    if (saved === null) {
      this.#flushPersisted(); // unreadable (reported): replaced by what this client holds
      return [];
    }
    const out = [];
    const stops = [];
    for (const [id, e] of Object.entries(saved)) {
      if (this.#requests.has(id) || !e || typeof e !== "object") continue;
      if (e.chat) {
        // A chat the server had not accepted when the app went (sent, waiting its turn, or refused for
        // now): sent again with the same id, which attaches to it if the server did take it (SPEC §10.2).
        let frame;
        try {
          frame = F.toWire({ ...e.chat, type: "chat", id });
        } catch {
          continue; // not a chat this client could have saved: skipped, never a crash at launch
        }
        const req = this.#track(id, frame, 0, null, "");
        // The last run may have sent it, and the server taken it: a Stop must reach the server (the chat
        // goes out again, attaching to it, then its cancel), not just end the stream here.
        req.inDoubt = 1;
        if (e.cancel === true) req.cancelRequested = true; // a Stop the last run could not deliver
        this.#drive(req);
        out.push({ id, stream: req.stream });
        continue;
      }
      let keep = typeof e.text === "string" && e.text.length > 0 && Number.isSafeInteger(e.offset) && e.offset > 0;
      let stream;
      try {
        stream = this.resume(id, keep ? { offset: e.offset, epoch: e.epoch ?? null, text: e.text } : {});
      } catch {
        // Its saved point is not one a server sent (an epoch out of range): the reply is replayed from 0
        // instead, as for an entry saved without its text. Only an id no request can have is skipped.
        keep = false;
        try {
          stream = this.resume(id, {});
        } catch {
          continue;
        }
      }
      // The stream starts with the saved text: one delta for [0, offset), then the rest as it comes.
      if (keep) stream._prime({ type: "delta", id, offset: 0, n: e.offset, text: e.text });
      if (e.cancel === true) stops.push(id); // a Stop the last run could not deliver: sent with the resume
      out.push({ id, stream });
    }
    // After the loop: cancel() saves the set, which must be whole by then.
    for (const id of stops) this.cancel(id);
    return out;
  }

  // -------------------------------------------------------------------------------- requests

  #track(id, frame, offset, epoch, text) {
    const req = {
      id,
      frame, // the chat frame, resent as is until accepted; null for resume-only requests
      accepted: false, // ever accepted: from then on it is resumed, never re-chatted
      // Sends of its chat frame that the server may have taken: each send adds one, and a refusal for
      // now (its answer) takes it back. One whose answer was lost with its connection stays.
      inDoubt: 0,
      unanswered: false, // the chat frame sent on this connection has had no answer yet
      phase: "queued", // queued | sent | attached (on the current connection)
      conn: null,
      requested: offset, // the offset asked for on the current attachment
      offset,
      epoch,
      resets: 0,
      cancelRequested: false,
      error: null, // an error frame that precedes done (too_large, internal)
      retryTimer: null,
      stream: new ChatStream(this, id),
    };
    req.stream.offset = offset;
    req.stream.text = text;
    req.stream.epoch = epoch;
    this.#requests.set(id, req);
    return req;
  }

  #bindSignal(req, signal) {
    if (req.stream.ended) return;
    if (signal.aborted) {
      this.cancel(req.id);
      return;
    }
    // Removed when the request ends: an app that reuses one signal for many chats would otherwise keep a
    // listener per chat, and its abort() would send a cancel for each one long finished.
    const onAbort = () => this.cancel(req.id);
    signal.addEventListener("abort", onAbort, { once: true });
    req.unbind = () => signal.removeEventListener("abort", onAbort);
  }

  /** Send what a request needs on the current connection, if it is open and the request is queued. */
  #drive(req) {
    const conn = this.#conn;
    if (!conn?.welcomed || req.phase !== "queued" || req.stream.ended) return;
    if (req.accepted) this.#sendResume(req, req.offset);
    else {
      let data;
      try {
        data = conn.codec.encode(req.frame);
      } catch (err) {
        this.#end(req, null, err);
        return;
      }
      const bytes = typeof data === "string" ? utf8Length(data) : data.byteLength;
      if (bytes > this.#maxFrameBytes()) {
        this.#end(req, null, new TokenwireError("too_large", `the chat frame is ${bytes} bytes; the server reads at most ${this.#maxFrameBytes()} (SPEC §2.2)`, { id: req.id }));
        return;
      }
      req.phase = "sent";
      req.conn = conn;
      req.inDoubt += 1;
      req.unanswered = true;
      req.requested = 0;
      this.#sendData(conn, data);
    }
    if (req.cancelRequested) this.#send(F.cancel({ id: req.id }));
  }

  #maxFrameBytes() {
    const n = this.welcome?.limits?.max_frame_bytes;
    return Number.isSafeInteger(n) && n > 0 ? n : DEFAULT_MAX_FRAME_BYTES;
  }

  #sendResume(req, offset) {
    req.phase = "sent";
    req.conn = this.#conn;
    req.requested = offset;
    // The epoch only matters with offset > 0: it makes the server refuse to splice two generations.
    this.#send(F.resume({ id: req.id, offset, epoch: offset > 0 ? req.epoch : null }));
  }

  #reset(req, reason) {
    req.resets += 1;
    if (req.resets > MAX_RESETS) {
      this.#end(req, null, new TokenwireError("resume_failed", `gave up after ${MAX_RESETS} restarts of the log`, { id: req.id }));
      return false;
    }
    req.offset = 0;
    req.epoch = null;
    if (req.stream.text !== "" || req.stream.offset !== 0) req.stream._push({ type: "reset", id: req.id, reason });
    this.emit("reset", { id: req.id, reason });
    return true;
  }

  #end(req, done, error = null) {
    clearTimeout(req.retryTimer);
    req.unbind?.();
    this.#requests.delete(req.id);
    req.stream._finish(done, error);
    // Done and handed to the app: no longer kept for a relaunch (closed by close(): kept, so that a
    // new client with the same storage picks it up).
    if (this.#persist && !(error?.code === "closed")) this.#flushPersisted();
  }

  // -------------------------------------------------------------------------------- persistence

  #persistSoon() {
    if (!this.#persist || this.#persistTimer) return;
    this.#persistTimer = setTimeout(() => {
      this.#persistTimer = null;
      this.#flushPersisted();
    }, PERSIST_EVERY_MS);
  }

  /**
   * Write the requests in flight (the newest MAX_PERSISTED): an accepted one as its offset, epoch and
   * text so far; one the server has not accepted yet (sent, waiting its turn, refused for now) as its
   * chat frame, to be sent again on restore. fitPersisted keeps the whole within MAX_PERSISTED_BYTES.
   */
  #flushPersisted() {
    if (!this.#persist) return;
    clearTimeout(this.#persistTimer);
    this.#persistTimer = null;
    if (!this.#persistArmed) return;
    const entries = {};
    const live = [...this.#requests.values()].filter((r) => !r.stream.ended && (r.accepted || r.frame));
    for (const req of live.slice(-MAX_PERSISTED)) {
      // A Stop not yet confirmed is kept with its request: an app killed before it reached the server
      // sends it at the next launch (restore), instead of letting the reply run on.
      const cancel = req.cancelRequested ? { cancel: true } : {};
      if (!req.accepted) {
        const chat = persistableChat(req.frame);
        if (chat) entries[req.id] = { chat, ...cancel };
        continue;
      }
      const text = req.stream.text;
      // More UTF-16 units than the budget is more bytes too: dropped without being counted.
      entries[req.id] = { ...(text.length <= MAX_PERSISTED_BYTES ? { offset: req.stream.offset, epoch: req.stream.epoch ?? null, text } : NO_TEXT), ...cancel };
    }
    fitPersisted(entries);
    this.#writePersisted(Object.keys(entries).length ? JSON.stringify(entries) : null);
  }

  /** Store `value` (null: remove it), one write at a time; see #persistWriting. */
  #writePersisted(value) {
    if (this.#persistWriting) {
      this.#persistNext = value;
      return;
    }
    let write;
    try {
      // Web Storage throws synchronously (QuotaExceededError), as MMKV may: reported, never thrown
      // out of a timer, a socket handler, pause() or close().
      write = value !== null ? this.#persist.setItem(this.#persistKey, value) : this.#persist.removeItem(this.#persistKey);
    } catch (err) {
      queueMicrotask(() => this.emit("error", err));
      return;
    }
    if (typeof write?.then !== "function") return; // a synchronous storage: written already
    this.#persistWriting = true;
    const next = () => {
      this.#persistWriting = false;
      const v = this.#persistNext;
      this.#persistNext = undefined;
      if (v !== undefined) this.#writePersisted(v);
    };
    Promise.resolve(write).then(next, (err) => {
      this.emit("error", err);
      next();
    });
  }

  /** The saved requests, {} when none, or null when the value is unreadable (reported as an error event). */
  async #readPersisted() {
    if (!this.#persist) return {};
    let raw;
    try {
      raw = await this.#persist.getItem(this.#persistKey);
    } catch (err) {
      this.emit("error", err); // never a crash at launch
      return null;
    }
    if (raw == null || raw === "") return {};
    try {
      const parsed = JSON.parse(raw);
      if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) return parsed;
    } catch {
      // reported below
    }
    const what = `${String(raw).length} characters`;
    this.emit("error", new TokenwireError("bad_persisted", `the persisted requests (${what}) are not a JSON object, cut short by the storage?: nothing restored`));
    return null;
  }

  // -------------------------------------------------------------------------------- connection

  #setState(state, info = {}) {
    const previous = this.#state;
    if (previous === state && state !== "reconnecting") return;
    this.#state = state;
    const ev = { state, previous, ...info };
    this.emit("state", ev);
    this.emit(state, ev);
  }

  async #loadSessionToken() {
    if (!this.#tokenLoaded) {
      this.#tokenLoaded = (async () => {
        if (this.#storage) {
          try {
            this.#sessionToken = (await this.#storage.getItem(this.#storageKey)) || null;
          } catch {
            this.#sessionToken = null;
          }
        }
      })();
    }
    return this.#tokenLoaded;
  }

  /** The stored session token, if it is one the server could have issued; else forgotten and reported. */
  #usableSessionToken() {
    const token = this.#sessionToken;
    if (token == null || token === "") return null;
    try {
      F.hello({ sessionToken: token });
      return token;
    } catch {
      // A storage that was written by something else, or corrupted: start a new session, as the server
      // would for a token it cannot read, instead of failing every hello with it.
      this.#sessionToken = null;
      try {
        Promise.resolve(this.#storage?.removeItem(this.#storageKey)).catch(() => {});
      } catch {
        // a storage that throws at once: forgotten in memory all the same
      }
      this.emit("error", new TokenwireError("bad_persisted", "the stored session token is not one the server issued: a new session"));
      return null;
    }
  }

  async #saveSessionToken(token) {
    if (token === this.#sessionToken) return;
    this.#sessionToken = token;
    try {
      if (this.#storage) await this.#storage.setItem(this.#storageKey, token);
    } catch (err) {
      this.emit("error", err);
    }
  }

  #open() {
    clearTimeout(this.#retryTimer);
    this.#retryTimer = null;
    // After a failed attempt #lost has said "reconnecting", with the delay: this attempt is that one.
    const next = this.#everOpen ? "reconnecting" : "connecting";
    if (this.#state !== next) this.#setState(next, { attempt: this.#attempt });
    const conn = { ws: null, codec: null, welcomed: false, helloSession: null, lastRx: monotonicMs(), pingTs: null, pingAt: 0, timers: [] };
    this.#conn = conn;
    this.#start(conn).catch((err) => this.#lost(conn, { code: 1006, reason: String(err?.message ?? err), abandon: true }));
  }

  async #start(conn) {
    await this.#loadSessionToken();
    const url = typeof this.#url === "function" ? resolveUrl(await this.#url()) : this.#url;
    if (this.#conn !== conn) return;
    const token = typeof this.#opts.token === "function" ? await this.#opts.token() : this.#opts.token;
    if (this.#conn !== conn) return;
    const ws = new this.#WebSocket(url, this.#subprotocols);
    ws.binaryType = "arraybuffer";
    conn.ws = ws;
    conn.token = token;
    const connectTimeoutMs = this.#opts.connectTimeoutMs ?? 10000;
    conn.timers.push(
      setTimeout(() => {
        if (!conn.welcomed) this.#lost(conn, { code: 4001, reason: "connect timeout", abandon: true });
      }, connectTimeoutMs),
    );
    ws.onopen = () => this.#onOpen(conn);
    ws.onmessage = (ev) => this.#onMessage(conn, ev.data);
    ws.onclose = (ev) => this.#lost(conn, { code: ev.code, reason: ev.reason });
    ws.onerror = () => {}; // a close event always follows
  }

  #onOpen(conn) {
    if (this.#conn !== conn) return;
    const proto = conn.ws.protocol;
    if (!this.#subprotocols.includes(proto)) {
      this.#lost(conn, { code: 4002, reason: `server chose subprotocol ${JSON.stringify(proto)}`, abandon: true });
      return;
    }
    conn.codec = createCodec(proto, this.#msgpack);
    // Every request the server has accepted before is resumed in the hello (at most 256 there; the
    // rest as resume frames after the welcome). Requests never accepted get their chat resent after it.
    const points = [];
    for (const req of this.#requests.values()) {
      req.phase = "queued";
      req.conn = null;
      req.unanswered = false; // its answer went with the connection: that send stays in doubt
      if (req.accepted && !req.stream.ended && points.length < F.MAX_RESUME_POINTS) {
        points.push({ id: req.id, offset: req.offset, epoch: req.offset > 0 ? req.epoch : null });
        req.phase = "sent";
        req.conn = conn;
        req.requested = req.offset;
      }
    }
    conn.helloSession = this.#usableSessionToken();
    let hello;
    try {
      hello = F.hello({
        token: conn.token ?? undefined,
        sessionToken: conn.helloSession,
        resume: points,
        coalesceMs: this.#opts.coalesceMs,
      });
    } catch (err) {
      // Only what a token() function returned can fail here (a token string and coalesceMs were checked at
      // construction, the session token just now, the resume points by resume(); an epoch beyond 2^31
      // from a server that breaks SPEC would too). Reported, and retried with backoff: a token()
      // function may return a good one next time.
      this.emit("error", err);
      this.#lost(conn, { code: 4004, reason: `hello: ${err.message}`.slice(0, 100), abandon: true });
      return;
    }
    if (points.length) this.emit("resume", { points });
    this.#sendOn(conn, hello);
    this.#startHeartbeat(conn);
  }

  #onMessage(conn, data) {
    if (this.#conn !== conn) return;
    conn.lastRx = monotonicMs();
    conn.pingTs = null; // any frame proves the connection alive
    let frame;
    try {
      frame = conn.codec.decode(data);
    } catch (err) {
      this.emit("error", err instanceof CodecError ? err : new CodecError(String(err)));
      return;
    }
    const problem = F.checkServerFrame(frame);
    if (problem) {
      this.emit("error", new TokenwireError("bad_frame", `from server: ${problem}`));
      return;
    }
    this.emit("frame", frame);
    if (!conn.welcomed) {
      this.#beforeWelcome(conn, frame);
      return;
    }
    const req = frame.id != null ? this.#requests.get(frame.id) : undefined;
    switch (frame.type) {
      case "accepted":
        if (req) this.#onAccepted(req, frame);
        break;
      case "waiting":
        // Held by the server, not lost: its accepted (or an error) follows. Still a chat to resend
        // after a drop, since the server forgets a waiting turn with its connection.
        if (req && !req.accepted) {
          // The server holds the turn now: its accepted or a refusal follows when its wait ends (SPEC
          // §4.2), and a refusal then may be the turn's or its cancel's, so the turn stays the server's
          // until it ends (a Stop of it waits to reach the server).
          req.unanswered = false;
          req.stream.state = "waiting";
          req.stream.waitingFor = frame.after ?? null;
          this.#flushPersisted(); // a waiting turn lives in this client alone: kept for a relaunch
          this.emit("waiting", { id: req.id, after: frame.after ?? null });
        }
        break;
      case "delta":
        if (req && req.phase === "attached" && req.conn === conn) this.#onDelta(req, frame);
        break;
      case "done":
        if (req && req.phase === "attached" && req.conn === conn) this.#onDone(req, frame);
        // A content-mode turn still waiting that this client cancelled: the server dropped it, and it
        // never existed there (SPEC §4.2).
        else if (req && req.phase === "sent" && req.conn === conn && !req.accepted && req.cancelRequested) this.#end(req, frame);
        break;
      case "error":
        if (req) this.#onRequestError(req, frame);
        else if (conn.quietIds?.delete(frame.id)) break; // the answer to a cancel of a chat ended since
        else this.emit("error", TokenwireError.fromFrame(frame));
        break;
      case "pong": {
        const waiter = this.#pings.get(frame.ts);
        this.#pings.delete(frame.ts);
        waiter?.ok();
        break;
      }
      default:
        break;
    }
  }

  #beforeWelcome(conn, frame) {
    if (frame.type === "welcome") {
      conn.welcomed = true;
      conn.welcomedAt = monotonicMs();
      this.welcome = frame;
      this.#everOpen = true;
      conn.retriedWithoutSession = false;
      this.#saveSessionToken(frame.session_token);
      this.#setState("open", { welcome: frame });
      for (const req of this.#requests.values()) {
        if (req.phase === "queued") this.#drive(req);
        else if (req.cancelRequested) this.#send(F.cancel({ id: req.id })); // resumed in the hello
      }
      return;
    }
    if (frame.type === "error") {
      conn.helloError = frame;
      const err = TokenwireError.fromFrame(frame);
      this.emit("error", err);
      if (frame.code === "internal") this.#lost(conn, { code: 1011, reason: "hello failed", abandon: true });
      // unauthorized / unsupported_version: the server closes (1008 / 1002); #lost decides.
    }
  }

  #onAccepted(req, f) {
    if (req.phase !== "sent" || req.conn !== this.#conn) {
      // An accepted we did not ask for on this connection (a duplicate resume): follow it anyway.
      req.conn = this.#conn;
    }
    req.phase = "attached";
    const first = !req.accepted;
    req.accepted = true;
    req.stream.state = f.state;
    // Saved at once, not at the next delta's throttled write: an app killed between its accepted and
    // that write must still find the request on relaunch.
    if (first) this.#flushPersisted();
    if (typeof f.model === "string") req.stream.model = f.model;
    if (req.epoch != null && req.epoch !== f.epoch) {
      // The log restarted under a new epoch: what we hold belongs to another generation (SPEC §10.4).
      if (!this.#reset(req, "epoch_changed")) return;
      req.epoch = f.epoch;
      req.stream.epoch = f.epoch;
      if (req.requested > 0) {
        this.#sendResume(req, 0);
        return;
      }
    }
    req.epoch = f.epoch;
    req.stream.epoch = f.epoch;
    // SPEC §8.9: on every accepted the expected offset is the offset asked for.
    req.offset = req.requested;
  }

  #onDelta(req, f) {
    if (f.offset === req.offset) {
      req.offset += f.n;
      if (req.stream.state === "queued") req.stream.state = "running";
      req.stream._push({ type: "delta", id: req.id, offset: f.offset, n: f.n, text: f.text });
      this.#persistSoon();
    } else if (f.offset + f.n <= req.offset) {
      // Already held: never show text twice.
    } else {
      // A gap (or a delta straddling what we hold): ask again from what we hold.
      this.emit("error", new TokenwireError("bad_frame", `delta at ${f.offset}+${f.n}, expected ${req.offset}; resyncing`, { id: req.id }));
      this.#sendResume(req, req.offset);
    }
  }

  #onDone(req, f) {
    if (f.offset !== req.offset) {
      this.emit("error", new TokenwireError("bad_frame", `done at ${f.offset}, expected ${req.offset}; resyncing`, { id: req.id }));
      this.#sendResume(req, req.offset);
      return;
    }
    if (f.finish_reason === "error") {
      const cause = req.error ?? { code: "internal", message: "generation failed", id: req.id };
      this.#end(req, f, TokenwireError.fromFrame(cause, f));
      return;
    }
    this.#end(req, f);
  }

  #onRequestError(req, f) {
    switch (f.code) {
      case "resume_failed":
        // The log we held is gone (or the offset was refused): drop the text, replay from 0.
        if (this.#reset(req, "resume_failed")) this.#sendResume(req, 0);
        return;
      case "not_found":
        if (req.cancelRequested && !req.accepted) {
          // Our cancel of a chat the server never took (refused for now, its retry not yet sent): there
          // is nothing to stop, and the stream ends cancelled, as the caller asked.
          this.#end(req, CANCELLED_UNSENT);
          return;
        }
        break;
      case "overloaded":
      case "rate_limited": {
        // Nothing was created: send the same frame again (same id) after the server's delay. The
        // chat's own answer (not a cancel's, refused after it) says this send is not the server's.
        if (req.unanswered && !req.accepted) req.inDoubt -= 1;
        req.unanswered = false;
        if (req.cancelRequested && !req.accepted && req.inDoubt === 0) {
          // Stopped while this send was on its way: nothing to retry. Its cancel went out after the
          // chat, and its answer (not_found, or rate_limited) follows for an id no longer tracked.
          (this.#conn.quietIds ??= new Set()).add(req.id);
          this.#end(req, CANCELLED_UNSENT);
          return;
        }
        req.phase = "queued";
        clearTimeout(req.retryTimer);
        req.retryTimer = setTimeout(() => this.#drive(req), f.retry_after_ms ?? 1000);
        return;
      }
      case "too_large":
      case "internal":
        if (req.phase === "attached") {
          req.error = f; // the done with finish_reason "error" follows
          return;
        }
        break;
      default:
        break;
    }
    this.#end(req, null, TokenwireError.fromFrame(f));
  }

  #send(frame) {
    if (this.#conn) this.#sendOn(this.#conn, frame);
  }

  #sendOn(conn, frame) {
    let data;
    try {
      data = conn.codec.encode(frame);
    } catch (err) {
      this.emit("error", err);
      return;
    }
    this.#sendData(conn, data);
  }

  #sendData(conn, data) {
    const ws = conn.ws;
    if (!ws || ws.readyState !== 1) return; // lost frames are resent from the request records
    try {
      ws.send(data);
    } catch (err) {
      this.emit("error", err);
    }
  }

  #startHeartbeat(conn) {
    const hb = this.#opts.heartbeat;
    if (hb === false) return;
    const activeMs = hb?.intervalMs ?? 2000; // no traffic for this long while a request is unfinished
    const idleMs = hb?.idleIntervalMs ?? 15000; // ... or while nothing is pending
    const timeoutMs = hb?.timeoutMs ?? 3000; // no frame at all this long after a ping: dead
    const period = Math.max(50, Math.min(1000, Math.min(activeMs, timeoutMs) / 4));
    const timer = setInterval(() => {
      if (this.#conn !== conn) return;
      const now = monotonicMs();
      if (conn.pingTs != null) {
        if (now - conn.pingAt >= timeoutMs) {
          this.#lost(conn, { code: 4003, reason: `no answer to ping in ${timeoutMs} ms`, abandon: true });
        }
        return;
      }
      const quiet = this.#requests.size ? activeMs : idleMs;
      if (conn.welcomed && now - conn.lastRx >= quiet) this.#probe(conn);
    }, period);
    conn.timers.push(timer);
  }

  #probe(conn) {
    if (!conn.welcomed || conn.pingTs != null) return;
    const ts = ++this.#pingSeq;
    conn.pingTs = ts;
    conn.pingAt = monotonicMs();
    const start = conn.pingAt;
    this.#pings.set(ts, {
      ok: () => {
        this.rttMs = monotonicMs() - start;
      },
      fail: () => {},
    });
    this.#sendOn(conn, F.ping(ts));
  }

  /** Drop a socket without waiting for its close handshake (which never ends on a dead network). */
  #abandon(conn, code, reason, { clean = false } = {}) {
    for (const t of conn.timers) {
      clearTimeout(t);
      clearInterval(t);
    }
    conn.timers = [];
    const ws = conn.ws;
    if (!ws) return;
    ws.onopen = ws.onmessage = ws.onclose = ws.onerror = null;
    ws.onerror = () => {};
    try {
      if (!clean && typeof ws.terminate === "function") ws.terminate();
      else ws.close(code >= 4000 && code < 5000 ? code : 1000, reason.slice(0, 100));
    } catch {
      // already closed
    }
  }

  #lost(conn, { code = 1006, reason = "", abandon = false }) {
    if (this.#conn !== conn) return;
    this.#conn = null;
    this.#abandon(conn, abandon ? code : 1000, reason);
    for (const req of this.#requests.values()) {
      req.phase = "queued";
      req.conn = null;
      req.unanswered = false; // its answer went with the connection: that send stays in doubt
    }
    const lostErr = new TokenwireError("not_connected", `connection lost (${code} ${reason})`);
    for (const waiter of this.#pings.values()) waiter.fail(lostErr);
    this.#pings.clear();
    if (FATAL_CLOSE_CODES.has(code) || conn.helloError?.code === "unsupported_version") {
      if (conn.helloError?.code === "unauthorized" && conn.helloSession && !this.#opts.keepSessionOnUnauthorized) {
        // Most likely the stored session token is stale or from another deployment: a new session.
        this.#sessionToken = null;
        try {
          Promise.resolve(this.#storage?.removeItem(this.#storageKey)).catch(() => {});
        } catch {
          // a storage that throws at once: the token is forgotten in memory all the same
        }
        this.#open();
        return;
      }
      const err = conn.helloError
        ? TokenwireError.fromFrame(conn.helloError)
        : new TokenwireError(code === 1008 ? "policy_violation" : "protocol_error", `closed ${code} ${reason}`);
      for (const req of [...this.#requests.values()]) this.#end(req, null, err);
      this.#offNetwork?.(); // closed for good, as close() does (connect() adds them again)
      this.#offNetwork = null;
      this.#setState("closed", { code, reason, error: err });
      return;
    }
    if (this.#paused || this.#offline) {
      // Backgrounded or without a network: wait for resume() / setOnline(true) instead of retrying.
      this.#setState(this.#paused ? "paused" : "offline", { code, reason });
      return;
    }
    if (conn.welcomed && monotonicMs() - conn.welcomedAt >= STABLE_MS) this.#attempt = 0;
    const delay = backoffDelay(this.#attempt, { ...this.#opts.backoff, random: this.#opts.backoff?.random });
    this.#attempt += 1;
    this.#setState("reconnecting", { code, reason, delay, attempt: this.#attempt });
    this.#retryTimer = setTimeout(() => this.#open(), delay);
  }

  #retryNow() {
    if (this.#state !== "reconnecting" || this.#conn) return;
    this.#open();
  }

  #watchNetwork() {
    // Browsers tell us when the network changes: probe the socket (or retry) at once instead of
    // waiting for the heartbeat or the backoff.
    const w = globalThis.window;
    if (!w || typeof w.addEventListener !== "function" || this.#opts.networkEvents === false) return;
    const onOnline = () => {
      if (this.#conn?.welcomed) this.#probe(this.#conn);
      else this.#retryNow();
    };
    const onVisible = () => {
      if (globalThis.document?.visibilityState === "visible" && this.#conn?.welcomed) this.#probe(this.#conn);
    };
    w.addEventListener("online", onOnline);
    globalThis.document?.addEventListener?.("visibilitychange", onVisible);
    this.#offNetwork = () => {
      w.removeEventListener("online", onOnline);
      globalThis.document?.removeEventListener?.("visibilitychange", onVisible);
    };
  }
}

/** UTF-8 byte length of a string (what the server counts for a JSON frame, SPEC §2.2). */
function utf8Length(s) {
  let n = 0;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c < 0x80) n += 1;
    else if (c < 0x800) n += 2;
    else if (c >= 0xd800 && c <= 0xdbff && i + 1 < s.length) {
      n += 4; // a surrogate pair: one astral character
      i++;
    } else n += 3;
  }
  return n;
}

/** A chat frame as plain JSON for `persist` (floats as numbers), or null when it cannot be kept small. */
function persistableChat(frame) {
  if (!frame) return null;
  try {
    const json = JSON.stringify(frame, (_, v) => {
      if (v instanceof WireFloat) return v.value;
      if (typeof v === "bigint") {
        if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new RangeError("seed beyond 2^53");
        return Number(v);
      }
      return v;
    });
    return json.length <= MAX_PERSISTED_BYTES && utf8Length(json) <= MAX_PERSISTED_BYTES ? JSON.parse(json) : null;
  } catch {
    return null;
  }
}

/**
 * Shrink `entries` (id -> saved entry) until their JSON is at most MAX_PERSISTED_BYTES of UTF-8 (what a
 * store caps, not UTF-16 units: CJK text takes 3 bytes a character). The saved text of the largest replies
 * goes first, each reply keeping its id (restored from offset 0: the server replays it whole); only if
 * the chats not accepted yet are still too large, the largest of them go (not restored).
 */
function fitPersisted(entries) {
  const size = (id, e) => utf8Length(JSON.stringify(id)) + 1 + utf8Length(JSON.stringify(e)); // "id":entry
  const sizes = Object.entries(entries).map(([id, e]) => [id, size(id, e)]);
  let total = 2 + sizes.reduce((n, [, s]) => n + s, 0) + Math.max(0, sizes.length - 1); // braces, commas
  if (total <= MAX_PERSISTED_BYTES) return;
  sizes.sort((a, b) => b[1] - a[1]);
  for (const [id, s] of sizes) {
    if (total <= MAX_PERSISTED_BYTES) return;
    if (entries[id].text) {
      const e = entries[id].cancel ? { ...NO_TEXT, cancel: true } : NO_TEXT;
      entries[id] = e;
      total += size(id, e) - s;
    }
  }
  for (const [id, s] of sizes) {
    if (total <= MAX_PERSISTED_BYTES) return;
    if (entries[id].chat) {
      delete entries[id];
      total -= s + 1; // and its comma
    }
  }
}

/** options.detachTimeoutMs: absent, or an integer of ms within what params.detach_timeout_ms takes. */
function checkDetachTimeout(v) {
  if (v == null) return;
  if (typeof v !== "number" || !Number.isInteger(v)) throw new TypeError(`detachTimeoutMs: expected an integer number of ms, got ${String(v)}`);
  if (v < 0 || v > F.MAX_DETACH_TIMEOUT_MS) throw new RangeError(`detachTimeoutMs: expected 0-${F.MAX_DETACH_TIMEOUT_MS} ms, got ${v}`);
}
