// tokenwire client for browsers without a bundler: the vendored ESM build of @msgpack/msgpack, served
// by the gateway next to this file (/src/browser.js -> /vendor/msgpack/index.mjs). Same API as index.js.
import * as msgpack from "../vendor/msgpack/index.mjs";
import { BaseClient, createCodecWith } from "./core.js";

export * from "./core.js";

export class TokenwireClient extends BaseClient {
  constructor(url, options = {}) {
    super(url, { msgpack, ...options });
  }
}

export function createCodec(subprotocol) {
  return createCodecWith(subprotocol, msgpack);
}
