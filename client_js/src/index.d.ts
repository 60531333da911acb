// Type declarations of the tokenwire JS client (protocol v1). The same API is exported by
// "@tokenwire/client" (Node, bundlers) and "@tokenwire/client/browser" (browsers without a bundler).

export const MSGPACK_SUBPROTOCOL: "tokenwire.v1.msgpack";
export const JSON_SUBPROTOCOL: "tokenwire.v1.json";
export const SUBPROTOCOLS: readonly ["tokenwire.v1.msgpack", "tokenwire.v1.json"];
export type Subprotocol = "tokenwire.v1.msgpack" | "tokenwire.v1.json";

/** "paused": after pause() and its grace (no socket, no retries); "offline": setOnline(false) and the socket lost. */
export type ConnectionState = "idle" | "connecting" | "open" | "reconnecting" | "paused" | "offline" | "closed";
/** At most this many requests in flight are kept by `persist` (the newest): 32. */
export const MAX_PERSISTED: number;
/**
 * The most UTF-8 bytes of the one value `persist` stores (60 KiB: under the 64 KiB some stores cap an entry
 * at; CJK text takes 3 bytes a character). Over it, the saved text of the largest replies is dropped first
 * (such a reply is kept as its id at offset 0 and replayed whole by the server on restore, so every
 * accepted request stays saved); only if the unaccepted chats alone are over it, the largest of them.
 */
export const MAX_PERSISTED_BYTES: number;
/** @deprecated No longer a bound of its own (every text that fits in MAX_PERSISTED_BYTES is shorter). */
export const MAX_PERSISTED_TEXT: number;
export const STATES: readonly ConnectionState[];

export type Role = "system" | "user" | "assistant";
export interface Message {
  role: Role;
  content: string;
}

/** Sampling parameters (SPEC §4.2); absent keys take the server's defaults. */
export interface ChatParams {
  /** 1–8192 (default 256). */
  max_tokens?: number;
  /** 0–2; 0 is greedy (default 0.2). Sent as a float. */
  temperature?: number;
  /** (0, 1] (default 0.9). Sent as a float. */
  top_p?: number;
  /** 0–1000; 0 is off (default). */
  top_k?: number;
  /** 0 to 2^63−1: same seed, same reply. Use a bigint above 2^53. */
  seed?: number | bigint;
  /** A stop string or up to 4 of them, 1–64 characters each. */
  stop?: string | string[];
  /** false: never answer this request from the server's response cache (deterministic requests only). */
  cache?: boolean;
  /** A model from `welcome.models` (or "default"); absent: the server's default model. */
  model?: string;
  /** false: never move this request to a lighter model when its model is overloaded (default true). */
  fallback?: boolean;
  /**
   * 0–3,600,000: keep this request running with nobody attached for this long (ms). The server uses
   * max(its default, min(this, welcome.limits.max_detach_timeout_ms)); 0 or absent: its default (30 s).
   * Default: the client's `detachTimeoutMs`, if set.
   */
  detach_timeout_ms?: number;
}

/**
 * "cancelled": a cancel ended it, or the server's detach timeout did (nobody attached for it): then
 * `cancelReason` is "detach_timeout". "length": its max_tokens reached or the model's context window
 * full; `lengthReason` says which, when the server does.
 */
export type FinishReason = "stop" | "length" | "cancelled" | "error";
/**
 * Why a request ended "cancelled" when it was not a cancel: "detach_timeout", the server cancelled it
 * because nobody was attached for its detach timeout (the app was away too long). null for a cancel (Stop),
 * for any other end, and for a cancel_reason this client does not know (SPEC §10.5: a plain cancel).
 */
export type CancelReason = "detach_timeout" | null;
/**
 * Which limit ended a request that finished "length" (SPEC §12, `done.length_reason`): "max_tokens", its
 * max_tokens, as asked or as lowered by the server under load (SPEC §4.2); "context", the model's context
 * window is full (more max_tokens would not help: start a new conversation or send a shorter one). null
 * for any other end, from a server that does not say (one before it), and for a value this client does
 * not know: then it may be either.
 */
export type LengthReason = "max_tokens" | "context" | null;
export type RequestState = "queued" | "running" | "done" | "failed" | "cancelled";

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  /** Of `prompt_tokens`, those the server did not compute again (0 from servers that predate it). */
  cached_tokens: number;
}

/** `n` tokens starting at token `offset`, and their text (whole UTF-8; may be empty). */
export interface DeltaItem {
  type: "delta";
  id: string;
  offset: number;
  n: number;
  text: string;
}

/** Throw away the text received so far for this request: its log restarted (SPEC §10.4). */
export interface ResetItem {
  type: "reset";
  id: string;
  reason: "epoch_changed" | "resume_failed";
}

export type StreamItem = DeltaItem | ResetItem;

export interface ChatResult {
  id: string;
  /** The whole completion text (what the deltas concatenate to). */
  text: string;
  finishReason: FinishReason;
  cancelReason: CancelReason;
  lengthReason: LengthReason;
  /** Total completion tokens. */
  offset: number;
  usage: Usage;
  epoch: number | null;
}

/** The stream of one request: iterate it for its items; it ends after `done`. */
export class ChatStream implements AsyncIterable<StreamItem> {
  readonly id: string;
  /** Text received so far. */
  readonly text: string;
  /** Tokens received so far (the next offset). */
  readonly offset: number;
  readonly epoch: number | null;
  /** The model that serves the request (`accepted.model`); null until accepted or if the server did not say. */
  readonly model: string | null;
  /**
   * "waiting": a content-mode turn the server holds until the session's previous turn ends (SPEC §4.2,
   * the `waiting` frame); its accepted follows. Show it as waiting, not lost.
   */
  readonly state: "pending" | "waiting" | RequestState;
  /** While waiting: the id of the turn it waits for, when the server said. */
  readonly waitingFor: string | null;
  readonly finishReason: FinishReason | null;
  /** Set at the end: "detach_timeout" when the server's detach timeout cancelled it, else null. */
  readonly cancelReason: CancelReason;
  /** Set at the end: with finishReason "length", the limit that ended it when the server said, else null. */
  readonly lengthReason: LengthReason;
  readonly ended: boolean;
  /** Resolves at `done`; rejects with a TokenwireError if the request failed or was lost. */
  readonly result: Promise<ChatResult>;
  /** Ask the server to stop the request; the stream then ends with finishReason "cancelled" (cancelReason null). */
  cancel(): void;
  /** Iterable once. Throws a TokenwireError at the end if the request failed. */
  [Symbol.asyncIterator](): AsyncIterator<StreamItem>;
}

/**
 * An error code of SPEC §6, or one of the client's own: "closed", "not_connected", "policy_violation",
 * "protocol_error", "bad_persisted" (an `error` event: restore() found a `persist` value that is not a JSON
 * object, e.g. cut short by the storage).
 */
export type ErrorCode =
  | "bad_frame"
  | "unsupported_version"
  | "unauthorized"
  | "not_found"
  | "idempotency_conflict"
  | "resume_failed"
  | "overloaded"
  | "rate_limited"
  | "too_large"
  | "internal"
  | "closed"
  | "not_connected"
  | "policy_violation"
  | "protocol_error"
  | "bad_persisted"
  | (string & {});

export class TokenwireError extends Error {
  readonly code: ErrorCode;
  readonly id?: string;
  readonly retryAfterMs?: number;
  /** The `done` frame that ended a failed request (finish_reason "error"), if any. */
  readonly done?: unknown;
  constructor(code: ErrorCode, message: string, details?: { id?: string; retryAfterMs?: number; done?: unknown });
}

/**
 * Web Storage style (localStorage fits); the methods may also return promises, which may settle in any
 * order: `persist` has one write under way at a time.
 */
export interface TokenStorage {
  getItem(key: string): string | null | Promise<string | null>;
  setItem(key: string, value: string): void | Promise<void>;
  removeItem(key: string): void | Promise<void>;
}

export class MemoryStorage implements TokenStorage {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
  removeItem(key: string): void;
}

/** localStorage when usable, else a MemoryStorage. */
export function defaultStorage(): TokenStorage;
/** react-native-mmkv's instance (getString/set/delete) as a TokenStorage, for `storage` and `persist`. */
export function mmkvStorage(mmkv: { getString(key: string): string | undefined; set(key: string, value: string): void; delete(key: string): void }): TokenStorage;

// ------------------------------------------------------------------------------------------ app lifecycle

/** React Native's AppState: "active" → client.resume(), "background" → client.pause({graceMs}). Returns an unsubscribe. */
export function withAppState(
  client: BaseClient,
  AppState: { addEventListener(type: "change", listener: (state: string) => void): { remove(): void } },
  options?: { graceMs?: number },
): () => void;
/** @react-native-community/netinfo: not connected, or isInternetReachable false → setOnline(false); else setOnline(true). */
export function withNetInfo(
  client: BaseClient,
  NetInfo: { addEventListener(listener: (state: { isConnected: boolean | null; isInternetReachable?: boolean | null }) => void): () => void },
): () => void;
/** The browser: hidden → pause, visible → resume; "offline"/"online" → setOnline. */
export function withBrowserLifecycle(client: BaseClient, options?: { window?: unknown; document?: unknown; graceMs?: number }): () => void;

export interface BackoffOptions {
  /** Cap of the first retry's delay (default 300 ms); doubles per failed attempt. */
  initialMs?: number;
  /** Largest cap (default 10000 ms). */
  maxMs?: number;
  /** Source of randomness in [0, 1) (default Math.random). */
  random?: () => number;
}

export interface HeartbeatOptions {
  /** Send a ping after this long without any frame while a request is unfinished (default 2000 ms). */
  intervalMs?: number;
  /** ... and after this long when nothing is pending (default 15000 ms). */
  idleIntervalMs?: number;
  /** No frame at all this long after a ping: the connection is dead, reconnect (default 3000 ms). */
  timeoutMs?: number;
}

/** What the client needs of a WebSocket: the browser API (the `ws` package in Node provides it). */
export interface WebSocketLike {
  readonly readyState: number;
  readonly protocol: string;
  binaryType: string;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code: number; reason: string }) => void) | null;
  onerror: ((ev: unknown) => void) | null;
  send(data: string | Uint8Array): void;
  close(code?: number, reason?: string): void;
}
export type WebSocketConstructor = new (url: string, protocols: string[]) => WebSocketLike;

export interface ClientOptions {
  /**
   * Ask the server for at most one delta per stream every this many ms (`hello.coalesce_ms`, 0-1000;
   * default 0: every delta as it comes). Fewer frames wake a phone's radio less; offsets stay exact,
   * so text and resume are unchanged. 100 suits mobile networks.
   */
  coalesceMs?: number;
  /**
   * Sent as `params.detach_timeout_ms` on every chat whose params do not name their own: how long (ms,
   * an integer 0–3,600,000, else a TypeError/RangeError here) the server should keep a request running
   * with nobody attached, e.g. 600000 for an app that may stay in the background for minutes. The server
   * caps it at `welcome.limits.max_detach_timeout_ms` (600,000 by default) and never goes below its own
   * default (30 s). Default: none (the server's default).
   */
  detachTimeoutMs?: number;
  /** HS256 JWT for servers with auth on, or a function returning one (called on every connect). */
  token?: string | (() => string | Promise<string>);
  /** Where the session token is kept (default: localStorage in browsers, memory elsewhere; null: nowhere). */
  storage?: TokenStorage | null;
  /** Storage key (default "tokenwire:session_token:<url>"). */
  storageKey?: string;
  /** Subprotocols to offer, in order of preference (default ["msgpack", "json"]). */
  subprotocols?: Array<"msgpack" | "json" | Subprotocol>;
  /** WebSocket implementation (default globalThis.WebSocket; in Node 20 pass `ws`). */
  WebSocket?: WebSocketConstructor;
  backoff?: BackoffOptions;
  /** Application ping/pong heartbeat; false turns it off. */
  heartbeat?: HeartbeatOptions | false;
  /** Give up on a connection attempt that has no welcome after this long (default 10000 ms). */
  connectTimeoutMs?: number;
  /** Connect on construction (default true). */
  autoConnect?: boolean;
  /** In browsers, probe or retry at once on "online" and when the page becomes visible (default true). */
  networkEvents?: boolean;
  /** Keep the stored session token when a hello is refused as unauthorized (default false: retry once without it). */
  keepSessionOnUnauthorized?: boolean;
  /**
   * Keep every request in flight in this storage (AsyncStorage as is, MMKV through mmkvStorage), in one
   * value of at most MAX_PERSISTED_BYTES of UTF-8: an accepted reply as its id, last offset, epoch and
   * the text so far (written at its accepted, then at most every 250 ms and at pause()); a chat not
   * accepted yet as its frame (written when made), so that after the app is killed a new client with
   * the same storage (and session token storage) can restore() them, before its first chat(). Nothing is
   * written before restore() or the first chat(): pause(), close() and the rest leave an earlier run's
   * value alone. Entries go once a request has ended and was handed to the app. A storage that throws
   * or rejects is reported as an `error` event, as is a value restore() cannot read (code
   * "bad_persisted"). Default: none.
   */
  persist?: TokenStorage | null;
}

export interface WelcomeFrame {
  type: "welcome";
  v: number;
  session: string;
  session_token: string;
  server: string;
  /** The server's limits (SPEC §5), e.g. max_frame_bytes, and max_detach_timeout_ms: the cap of params.detach_timeout_ms. */
  limits: Record<string, number>;
  /** The models a chat may name in `params.model`, the default first (absent: not known). */
  models?: string[];
  /**
   * The models no worker serves yet (still loading, or no worker up; "default" while a cluster does not
   * know the default's name): their chats and replies wait in the queue. A snapshot at welcome; absent:
   * none known to be loading (SPEC §5).
   */
  loading?: string[];
}

export interface StateEvent {
  state: ConnectionState;
  previous: ConnectionState;
  /** Close code of the connection that was lost (reconnecting, closed); 4001 connect timeout, 4003 heartbeat, 4004 a hello this client could not send (what token() returned). */
  code?: number;
  reason?: string;
  /** Delay before the next attempt (reconnecting: one event per failed attempt, with its delay). */
  delay?: number;
  attempt?: number;
  welcome?: WelcomeFrame;
  error?: TokenwireError;
}

export interface ClientEvents {
  state: StateEvent;
  idle: StateEvent;
  connecting: StateEvent;
  open: StateEvent;
  reconnecting: StateEvent;
  paused: StateEvent;
  offline: StateEvent;
  closed: StateEvent;
  /** A hello carried these resume points. */
  resume: { points: Array<{ id: string; offset: number; epoch?: number | null }> };
  /** The server holds this content-mode turn until the session's previous turn ends (`waiting` frame). */
  waiting: { id: string; after: string | null };
  /** A request's text was discarded (see ResetItem). */
  reset: { id: string; reason: ResetItem["reason"] };
  /** Every valid frame received. */
  frame: Record<string, unknown> & { type: string };
  /** Problems that do not belong to one request (errors without an id, undecodable frames). */
  error: Error;
}

/** The client without a msgpack implementation of its own (pass `options.msgpack`); see TokenwireClient. */
export class BaseClient {
  constructor(url: string | (() => string | Promise<string>), options?: ClientOptions & { msgpack?: unknown });
  readonly state: ConnectionState;
  readonly sessionToken: string | null;
  /** The negotiated subprotocol while open. */
  readonly subprotocol: Subprotocol | null;
  /** The last welcome frame. */
  readonly welcome: WelcomeFrame | null;
  /** Round-trip time of the last heartbeat ping, in ms. */
  readonly rttMs: number | null;
  /** Ids of unfinished requests. */
  readonly pending: string[];

  on<K extends keyof ClientEvents>(type: K, listener: (event: ClientEvents[K]) => void): () => void;
  off<K extends keyof ClientEvents>(type: K, listener: (event: ClientEvents[K]) => void): void;
  once<K extends keyof ClientEvents>(type: K): Promise<ClientEvents[K]>;

  /** Resolves with the welcome once connected (reopens a closed client). */
  connect(): Promise<WelcomeFrame>;
  /**
   * Start a request: a string is one user turn appended to the session history (content mode), an
   * array is the whole conversation (messages mode). Unaccepted requests are retried with the same id
   * after a reconnect; accepted ones are resumed from the last token received.
   */
  chat(input: string | Message[], params?: ChatParams, options?: { id?: string; signal?: AbortSignal }): ChatStream;
  /** Attach to an existing request of this owner from `offset` (0 replays it whole). */
  resume(id: string, options?: { offset?: number; epoch?: number | null; text?: string; signal?: AbortSignal }): ChatStream;
  /**
   * Without an id: the app is in the foreground again. Reconnect now, skipping the backoff, and resume
   * every reply in flight from its last offset (an open socket is probed). After setOnline(false) it
   * waits in state "offline" until setOnline(true).
   */
  resume(): void;
  /**
   * The app went to the background: close the socket cleanly after `graceMs` (default 5000) and try no
   * reconnect until resume(). Never a cancel: the server runs every request on, for its detach timeout
   * (30 s by default; `detachTimeoutMs` asks for longer). Away longer, a reply ends "cancelled" with
   * cancelReason "detach_timeout".
   */
  pause(options?: { graceMs?: number }): void;
  /** Whether the device has a network: offline, a lost socket waits instead of retrying; online, reconnect at once. */
  setOnline(online: boolean): void;
  /**
   * The requests `persist` kept from an earlier run: replies resumed from their saved offsets (each
   * stream yields the saved text first, as one delta from offset 0), chats not accepted then sent again
   * with their ids.
   */
  restore(): Promise<Array<{ id: string; stream: ChatStream }>>;
  /** Stop a request (sent again after a reconnect until the request ends). A chat the server holds
   * nothing of (never sent, or every send refused for now) ends "cancelled" at once, also offline. */
  cancel(id: string): void;
  /** Application ping; resolves with the round-trip time in ms. */
  ping(): Promise<number>;
  /** Drop the current socket and reconnect now (as after a network change). */
  reconnectNow(reason?: string): void;
  /** Forget the stored session token: the next connection starts a new session. */
  forgetSession(): Promise<void>;
  /** Close for good (until connect()); unfinished streams fail with code "closed". */
  close(): void;
}

/** The tokenwire client, with @msgpack/msgpack built in (msgpack preferred, JSON as the fallback). */
export class TokenwireClient extends BaseClient {
  /** `url`: ws(s)://host:port/v1/ws (in browsers a path like "/v1/ws" also works), or a function giving one per attempt. */
  constructor(url: string | (() => string | Promise<string>), options?: ClientOptions);
}

/** Delay before reconnect attempt `attempt` (0-based): uniform in [0, min(maxMs, initialMs·2^attempt)). */
export function backoffDelay(attempt: number, options?: BackoffOptions): number;
/** A random 32-hex-digit request id. */
export function newId(): string;

// ------------------------------------------------------------------------------------------ codecs

/** A number sent as a float even when integral (temperature 2 → 2.0). */
export class WireFloat {
  constructor(value: number);
  readonly value: number;
}
export class CodecError extends Error {}

export type Frame = Record<string, unknown> & { type: string };

export interface Codec {
  readonly subprotocol: Subprotocol;
  readonly binary: boolean;
  /** Uint8Array (msgpack) or string (JSON), as WebSocket#send takes it. */
  encode(frame: Frame): Uint8Array | string;
  /** One WebSocket message to a frame map; throws CodecError. Integers past 2^53 are bigints. */
  decode(data: ArrayBuffer | Uint8Array | string): Frame;
}

/** The codec of a subprotocol, with this entry point's msgpack. */
export function createCodec(subprotocol: Subprotocol): Codec;
export function createCodecWith(subprotocol: Subprotocol, msgpack: unknown): Codec;
export class MsgpackCodec {
  constructor(msgpack: unknown);
  encode(value: unknown): Uint8Array;
  decode(bytes: Uint8Array): unknown;
}
/** JSON text exactly as Python's json.dumps(separators=(",", ":"), ensure_ascii=False) writes it. */
export function jsonEncode(value: unknown): string;
/** One JSON value; integers past 2^53 come back as bigints. */
export function jsonDecode(text: string): unknown;
/** Python's repr() of a float. */
export function pythonFloatRepr(x: number): string;
export function toHex(bytes: Uint8Array): string;
export function fromHex(hex: string): Uint8Array;

/** Builders and checks of client frames, in the field order the Python codecs use. */
export namespace frames {
  const PROTOCOL_VERSION: 1;
  const MAX_ID_CHARS: number;
  const MAX_MESSAGES: number;
  const MAX_RESUME_POINTS: number;
  const MAX_STOP_STRINGS: number;
  const MAX_STOP_CHARS: number;
  const MAX_MAX_TOKENS: number;
  const MAX_TOKEN_CHARS: number;
  /** The largest params.detach_timeout_ms (3,600,000). */
  const MAX_DETACH_TIMEOUT_MS: number;
  const ROLES: readonly Role[];
  const FINISH_REASONS: readonly FinishReason[];
  /** The done.length_reason values this client knows. */
  const LENGTH_REASONS: readonly Exclude<LengthReason, null>[];
  const REQUEST_STATES: readonly RequestState[];
  function codePoints(s: string): number;
  function checkId(id: string, where?: string): string;
  function hello(options?: { token?: string; sessionToken?: string | null; resume?: Array<{ id: string; offset: number; epoch?: number | null }> }): Frame;
  function params(p?: ChatParams): Record<string, unknown>;
  function chat(f: { id: string; content?: string; messages?: Message[]; params?: ChatParams }): Frame;
  function resume(f: { id: string; offset: number; epoch?: number | null }): Frame;
  function cancel(f: { id: string }): Frame;
  function ping(ts?: number | bigint): Frame;
  /** Any client frame map rebuilt in wire form (field order, float typing). */
  function toWire(frame: Frame): Frame;
  /** null when a decoded server frame has the fields the client relies on, else what is wrong. */
  function checkServerFrame(frame: Frame): string | null;
}
