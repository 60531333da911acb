// tokenwire client for Node and bundlers: @msgpack/msgpack from node_modules.
import * as msgpack from "@msgpack/msgpack";
import { BaseClient, createCodecWith } from "./core.js";

export * from "./core.js";

/** The tokenwire client; see index.d.ts. Speaks msgpack (preferred) and JSON. */
export class TokenwireClient extends BaseClient {
  constructor(url, options = {}) {
    super(url, { msgpack, ...options });
  }
}

/** The codec of a subprotocol ("tokenwire.v1.msgpack" or "tokenwire.v1.json"). */
export function createCodec(subprotocol) {
  return createCodecWith(subprotocol, msgpack);
}
