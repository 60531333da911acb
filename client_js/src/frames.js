// Client frames of protocol v1 (SPEC §4), built in the field order the Python dataclasses use, checked
// before they are sent, so a caller's mistake is a TypeError/RangeError here rather than a bad_frame later.

import { WireFloat } from "./codec.js";

export const PROTOCOL_VERSION = 1;
export const MAX_ID_CHARS = 64;
export const MAX_MESSAGES = 256;
export const MAX_RESUME_POINTS = 256;
export const MAX_STOP_STRINGS = 4;
export const MAX_STOP_CHARS = 64;
export const MAX_MAX_TOKENS = 8192;
export const MAX_TOKEN_CHARS = 4096;
// params.detach_timeout_ms: how long the server keeps a request running with nobody attached (SPEC §4.2;
// it lowers the value to welcome.limits.max_detach_timeout_ms, and never below its own default).
export const MAX_DETACH_TIMEOUT_MS = 3600000;
export const ROLES = Object.freeze(["system", "user", "assistant"]);
export const FINISH_REASONS = Object.freeze(["stop", "length", "cancelled", "error"]);
// done.length_reason (SPEC §12): which limit ended a `length` reply. Servers may add others.
export const LENGTH_REASONS = Object.freeze(["max_tokens", "context"]);
export const REQUEST_STATES = Object.freeze(["queued", "running", "done", "failed", "cancelled"]);
const MAX_SEED = 2n ** 63n - 1n;

/** Length in Unicode code points, as the SPEC counts (not UTF-16 units). */
export function codePoints(s) {
  let n = 0;
  for (const _ of s) n++;
  return n;
}

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/**
 * `s` as it is, or a RangeError when it holds a lone UTF-16 surrogate (half an emoji, from a string cut
 * in the middle of one): SPEC §2.1 forbids them, and the server cannot decode such a frame, so it could
 * answer only with an error that names no request.
 */
export function checkText(s, where) {
  const wellFormed = typeof s.isWellFormed === "function" ? s.isWellFormed() : !LONE_SURROGATE.test(s);
  if (!wellFormed) throw new RangeError(`${where}: holds a lone UTF-16 surrogate (half of a character); SPEC §2.1`);
  return s;
}

export function checkId(id, where = "id") {
  if (typeof id !== "string") throw new TypeError(`${where}: expected a string, got ${typeof id}`);
  checkText(id, where);
  const n = codePoints(id);
  if (n < 1 || n > MAX_ID_CHARS) throw new RangeError(`${where}: expected 1-${MAX_ID_CHARS} characters, got ${n}`);
  // eslint-disable-next-line no-control-regex
  if (/[\u0000-\u001f\u007f]/.test(id)) throw new RangeError(`${where}: control characters are not allowed`);
  return id;
}

function checkOffset(v, where) {
  if (!Number.isSafeInteger(v) || v < 0) throw new RangeError(`${where}: expected a non-negative integer, got ${v}`);
  return v;
}

function checkEpoch(v, where) {
  if (!Number.isSafeInteger(v) || v < 1 || v > 2 ** 31) throw new RangeError(`${where}: expected an integer in [1, 2^31], got ${v}`);
  return v;
}

function num(v) {
  return v instanceof WireFloat ? v.value : v;
}

function isInt(v) {
  return (typeof v === "number" && Number.isInteger(v)) || typeof v === "bigint";
}

export const MAX_COALESCE_MS = 1000;

export function hello({ token, sessionToken, resume, coalesceMs } = {}) {
  const f = { type: "hello", v: PROTOCOL_VERSION };
  if (coalesceMs != null && coalesceMs !== 0) {
    if (!Number.isInteger(coalesceMs) || coalesceMs < 0 || coalesceMs > MAX_COALESCE_MS) {
      throw new RangeError(`coalesceMs: an integer from 0 to ${MAX_COALESCE_MS}`);
    }
    f.coalesce_ms = coalesceMs;
  }
  if (token != null) f.token = checkString(token, "token", MAX_TOKEN_CHARS);
  if (sessionToken != null && sessionToken !== "") f.session_token = checkString(sessionToken, "session_token", MAX_TOKEN_CHARS);
  if (resume && resume.length) {
    if (resume.length > MAX_RESUME_POINTS) throw new RangeError(`resume: at most ${MAX_RESUME_POINTS} points`);
    f.resume = resume.map((p, i) => resumePoint(p, `resume[${i}]`));
  }
  return f;
}

function checkString(v, where, limit) {
  if (typeof v !== "string") throw new TypeError(`${where}: expected a string`);
  checkText(v, where);
  if (codePoints(v) > limit) throw new RangeError(`${where}: longer than ${limit} characters`);
  return v;
}

function resumePoint(p, where) {
  const out = { id: checkId(p.id, `${where}.id`), offset: checkOffset(p.offset, `${where}.offset`) };
  if (p.epoch != null) out.epoch = checkEpoch(p.epoch, `${where}.epoch`);
  return out;
}

/**
 * Sampling parameters in wire form: only the keys given (absent ≠ default, SPEC §10.1), in the
 * Python order, temperature and top_p as floats (WireFloat). `cache: false` opts out of the server's
 * response cache (SPEC §4.2).
 */
export function params(p = {}) {
  if (p === null || typeof p !== "object" || Array.isArray(p)) throw new TypeError("params: expected an object");
  const out = {};
  const intIn = (key, lo, hi) => {
    const v = p[key];
    if (v == null) return;
    if (!isInt(v)) throw new TypeError(`params.${key}: expected an integer, got ${v}`);
    if (BigInt(v) < BigInt(lo) || BigInt(v) > BigInt(hi)) throw new RangeError(`params.${key}: expected an integer in [${lo}, ${hi}], got ${v}`);
    out[key] = typeof v === "bigint" && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;
  };
  const floatIn = (key, lo, hi, loOpen) => {
    const raw = p[key];
    if (raw == null) return;
    const v = num(raw);
    if (typeof v !== "number" || !Number.isFinite(v)) throw new TypeError(`params.${key}: expected a finite number, got ${raw}`);
    if (v < lo || v > hi || (loOpen && v === lo)) throw new RangeError(`params.${key}: expected a number in ${loOpen ? "(" : "["}${lo}, ${hi}], got ${v}`);
    out[key] = new WireFloat(v);
  };
  intIn("max_tokens", 1, MAX_MAX_TOKENS);
  floatIn("temperature", 0, 2, false);
  floatIn("top_p", 0, 1, true);
  intIn("top_k", 0, 1000);
  intIn("seed", 0, MAX_SEED);
  if (p.cache != null) {
    if (typeof p.cache !== "boolean") throw new TypeError(`params.cache: expected a boolean, got ${p.cache}`);
    out.cache = p.cache;
  }
  // Penalties (SPEC §4.2): repetition in (0, 2], frequency and presence in [−2, 2].
  floatIn("repetition_penalty", 0, 2, true);
  floatIn("frequency_penalty", -2, 2, false);
  floatIn("presence_penalty", -2, 2, false);
  if (p.model != null) {
    // A served model's name (welcome.models), or "default" (SPEC §4.2).
    if (typeof p.model !== "string" || codePoints(p.model) < 1 || codePoints(p.model) > 128) {
      throw new TypeError(`params.model: expected a model name of 1-128 characters, got ${p.model}`);
    }
    out.model = checkText(p.model, "params.model");
  }
  if (p.fallback != null) {
    if (typeof p.fallback !== "boolean") throw new TypeError(`params.fallback: expected a boolean, got ${p.fallback}`);
    out.fallback = p.fallback;
  }
  intIn("detach_timeout_ms", 0, MAX_DETACH_TIMEOUT_MS);
  const stop = p.stop;
  if (stop != null) {
    const items = typeof stop === "string" ? [stop] : stop;
    if (!Array.isArray(items) || items.length > MAX_STOP_STRINGS) throw new RangeError(`params.stop: a string or an array of at most ${MAX_STOP_STRINGS}`);
    for (const s of items) {
      if (typeof s !== "string" || codePoints(s) < 1 || codePoints(s) > MAX_STOP_CHARS) throw new RangeError(`params.stop: each stop string must have 1-${MAX_STOP_CHARS} characters`);
      checkText(s, "params.stop");
    }
    if (items.length) out.stop = [...items];
  }
  return out;
}

/** A chat frame: `content` (a string: content mode) or `messages` (an array: messages mode). */
export function chat({ id, content, messages, params: p }) {
  const f = { type: "chat", id: checkId(id) };
  if ((content == null) === (messages == null)) throw new TypeError("chat: exactly one of content or messages");
  if (content != null) {
    if (typeof content !== "string" || content === "") throw new TypeError("chat: content must be a non-empty string");
    f.content = checkText(content, "chat: content");
  } else {
    if (!Array.isArray(messages) || messages.length < 1 || messages.length > MAX_MESSAGES) {
      throw new RangeError(`chat: messages must be an array of 1-${MAX_MESSAGES} {role, content}`);
    }
    f.messages = messages.map((m, i) => {
      if (!m || !ROLES.includes(m.role)) throw new RangeError(`messages[${i}].role: expected one of ${ROLES.join(", ")}`);
      if (typeof m.content !== "string") throw new TypeError(`messages[${i}].content: expected a string`);
      return { role: m.role, content: checkText(m.content, `messages[${i}].content`) };
    });
  }
  const wp = params(p ?? {});
  if (Object.keys(wp).length) f.params = wp;
  return f;
}

export function resume({ id, offset, epoch }) {
  const f = { type: "resume", id: checkId(id), offset: checkOffset(offset, "offset") };
  if (epoch != null) f.epoch = checkEpoch(epoch, "epoch");
  return f;
}

export function cancel({ id }) {
  return { type: "cancel", id: checkId(id) };
}

export function ping(ts) {
  const f = { type: "ping" };
  if (ts != null) {
    if ((typeof ts !== "number" || !Number.isFinite(ts)) && typeof ts !== "bigint") throw new TypeError("ping.ts: expected a finite number");
    f.ts = ts;
  }
  return f;
}

/**
 * Any client frame map (as decoded, or written by hand) rebuilt in wire form: field order and float
 * typing as the Python codecs emit them. encode(toWire(f)) is what a conforming client sends.
 */
export function toWire(frame) {
  switch (frame.type) {
    case "hello":
      return hello({ token: frame.token, sessionToken: frame.session_token, resume: frame.resume, coalesceMs: frame.coalesce_ms });
    case "chat":
      return chat(frame);
    case "resume":
      return resume(frame);
    case "cancel":
      return cancel(frame);
    case "ping":
      return ping(frame.ts);
    default:
      throw new TypeError(`not a client frame type: ${frame.type}`);
  }
}

const SERVER_TYPES = new Set(["welcome", "accepted", "waiting", "delta", "done", "error", "pong"]);

/**
 * Check a decoded server frame (SPEC §5) enough to rely on it: the fields the client reads have the
 * right types. Returns null when it is fine, else a message. Unknown keys are ignored.
 */
export function checkServerFrame(f) {
  const str = (k) => typeof f[k] === "string";
  const int = (k, lo = 0) => Number.isSafeInteger(f[k]) && f[k] >= lo;
  if (!SERVER_TYPES.has(f.type)) return `unknown server frame type ${JSON.stringify(f.type)}`;
  switch (f.type) {
    case "welcome":
      return int("v") && str("session") && str("session_token") && str("server") ? null : "welcome: bad fields";
    case "accepted":
      return str("id") && int("epoch", 1) && str("state") ? null : "accepted: bad fields";
    case "waiting":
      return str("id") && (f.after == null || str("after")) ? null : "waiting: bad fields";
    case "delta":
      return str("id") && int("offset") && int("n") && str("text") ? null : "delta: bad fields";
    case "done":
      // length_reason: any string, on a `length` end only (SPEC §5); absent from servers before it.
      return str("id") && int("offset") && FINISH_REASONS.includes(f.finish_reason) &&
        (f.length_reason == null || (str("length_reason") && f.finish_reason === "length"))
        ? null
        : "done: bad fields";
    case "error":
      return str("code") && (f.id == null || str("id")) ? null : "error: bad fields";
    default:
      return null;
  }
}
