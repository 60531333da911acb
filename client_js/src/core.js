// Everything but the msgpack implementation, which the entry points (index.js for Node and bundlers,
// browser.js for browsers without a bundler) pass in.
export {
  TokenwireClient as BaseClient,
  ChatStream,
  TokenwireError,
  STATES,
  MAX_PERSISTED,
  MAX_PERSISTED_BYTES,
  MAX_PERSISTED_TEXT,
  backoffDelay,
  newId,
} from "./client.js";
export {
  MSGPACK_SUBPROTOCOL,
  JSON_SUBPROTOCOL,
  SUBPROTOCOLS,
  WireFloat,
  CodecError,
  MsgpackCodec,
  createCodec as createCodecWith,
  jsonEncode,
  jsonDecode,
  pythonFloatRepr,
  toHex,
  fromHex,
} from "./codec.js";
export * as frames from "./frames.js";
export { MemoryStorage, defaultStorage, mmkvStorage } from "./storage.js";
export { withAppState, withNetInfo, withBrowserLifecycle } from "./lifecycle.js";
