// The golden vectors of protocol/vectors/frames.json: this client encodes every valid frame to exactly
// the bytes Python's codecs emit (msgpack and JSON), and decodes those bytes back to the same frame.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import test from "node:test";

import * as msgpack from "@msgpack/msgpack";

import { createCodec, createCodecWith, frames, fromHex, jsonDecode, jsonEncode, pythonFloatRepr, toHex, WireFloat } from "../src/index.js";
import { vendoredFiles } from "../scripts/vendor-msgpack.mjs";
import { CLIENT_JS, REPO } from "../testing/server.js";

// Read with the client's own exact JSON parser: the vectors hold a seed of 2^63-1, past 2^53.
const VECTORS = jsonDecode(readFileSync(join(REPO, "protocol", "vectors", "frames.json"), "utf8"));
const MSGPACK = createCodec("tokenwire.v1.msgpack");
const JSON_ = createCodec("tokenwire.v1.json");

test("the vector file is version 1 and has client and server frames", () => {
  assert.equal(VECTORS.version, 1);
  const dirs = new Set(VECTORS.valid.map((v) => v.direction));
  assert.deepEqual([...dirs].sort(), ["client", "server"]);
  assert.ok(VECTORS.valid.length >= 40, `only ${VECTORS.valid.length} valid vectors`);
});

test("every valid vector encodes to Python's exact bytes, both subprotocols", async (t) => {
  for (const v of VECTORS.valid) {
    await t.test(v.name, () => {
      // Client frames go through the same builder the client uses to send them (field order, floats).
      const frame = v.direction === "client" ? frames.toWire(v.frame) : v.frame;
      assert.equal(toHex(MSGPACK.encode(frame)), v.msgpack_hex, "msgpack bytes");
      assert.equal(JSON_.encode(frame), v.json, "JSON text");
    });
  }
});

test("every valid vector decodes to the same frame, both subprotocols", async (t) => {
  for (const v of VECTORS.valid) {
    await t.test(v.name, () => {
      const fromMsgpack = MSGPACK.decode(fromHex(v.msgpack_hex));
      const fromJson = JSON_.decode(v.json);
      assert.deepEqual(fromMsgpack, v.frame);
      assert.deepEqual(fromJson, v.frame);
      if (v.direction === "server") assert.equal(frames.checkServerFrame(fromMsgpack), null);
    });
  }
});

test("big integers survive both codecs as BigInt; small ones stay numbers", () => {
  const seed = 2n ** 63n - 1n;
  const f = frames.chat({ id: "r", content: "x", params: { seed, max_tokens: 5 } });
  assert.equal(typeof MSGPACK.decode(MSGPACK.encode(f)).params.seed, "bigint");
  assert.equal(MSGPACK.decode(MSGPACK.encode(f)).params.seed, seed);
  assert.equal(JSON_.decode(JSON_.encode(f)).params.seed, seed);
  assert.equal(JSON_.decode(JSON_.encode(f)).params.max_tokens, 5);
  assert.equal(MSGPACK.decode(MSGPACK.encode({ type: "pong", ts: 1700000000000 })).ts, 1700000000000);
});

test("float-typed params are floats on the wire even when integral (like Python's 2.0)", () => {
  const f = frames.chat({ id: "r", content: "x", params: { temperature: 2, top_p: 1 } });
  assert.ok(f.params.temperature instanceof WireFloat);
  assert.equal(JSON_.encode(f), '{"type":"chat","id":"r","content":"x","params":{"temperature":2.0,"top_p":1.0}}');
  assert.equal(toHex(MSGPACK.encode({ t: new WireFloat(2) })), "81a174cb4000000000000000");
});

test("floats are written as Python's repr writes them", () => {
  const cases = [
    [0.7, "0.7"], [2, "2.0"], [0.1 + 0.2, "0.30000000000000004"], [1e-4, "0.0001"], [1e-5, "1e-05"],
    [1.5e-7, "1.5e-07"], [1e15, "1000000000000000.0"], [1e16, "1e+16"], [123456.789, "123456.789"],
    [-0.25, "-0.25"], [1700000000.25, "1700000000.25"], [5e-324, "5e-324"], [1.7976931348623157e308, "1.7976931348623157e+308"],
  ];
  for (const [x, want] of cases) assert.equal(pythonFloatRepr(x), want, String(x));
  assert.equal(jsonEncode({ a: [1, 2.5, "é\n\u0007", null, true] }), '{"a":[1,2.5,"é\\n\\u0007",null,true]}');
});

test("the JSON decoder refuses what is not exactly one JSON value", () => {
  const bad = VECTORS.invalid.filter((v) =>
    ["json_invalid", "json_empty_message", "json_single_quotes", "json_trailing_garbage", "json_two_objects", "json_nan", "json_infinity"].includes(v.name),
  );
  assert.equal(bad.length, 7);
  for (const v of bad) assert.throws(() => JSON_.decode(v.data_text), { name: "CodecError" }, v.name);
  assert.throws(() => JSON_.decode("[1,2]"), { name: "CodecError" });
  assert.throws(() => MSGPACK.decode(fromHex("81a474797065")), { name: "CodecError" }); // truncated
  assert.throws(() => MSGPACK.decode('{"type":"pong"}'), { name: "CodecError" }); // text on msgpack
  assert.throws(() => JSON_.decode(new Uint8Array([123, 125])), { name: "CodecError" }); // binary on JSON
});

test("the client refuses to build frames the server would reject as bad_frame", () => {
  assert.throws(() => frames.chat({ id: "x".repeat(65), content: "hi" }), RangeError);
  assert.throws(() => frames.chat({ id: "a\u0007b", content: "hi" }), RangeError);
  assert.throws(() => frames.chat({ id: "r", content: "" }), TypeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", messages: [] }), TypeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", params: { temperature: 3 } }), RangeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", params: { top_p: 0 } }), RangeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", params: { max_tokens: 1.5 } }), TypeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", params: { max_tokens: 8193 } }), RangeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", params: { stop: ["a", "b", "c", "d", "e"] } }), RangeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", params: { seed: 2n ** 63n } }), RangeError);
  assert.throws(() => frames.chat({ id: "r", content: "hi", params: { cache: "no" } }), TypeError);
  assert.throws(() => frames.resume({ id: "r", offset: -1 }), RangeError);
  assert.throws(() => frames.resume({ id: "r", offset: 1, epoch: 0 }), RangeError);
  // 64 code points is fine even when that is more UTF-16 units.
  assert.equal(frames.chat({ id: "🚀".repeat(64), content: "hi" }).id.length, 128);
});

test("the vendored @msgpack/msgpack (served to browsers) is the locked version, unmodified", () => {
  const pkg = JSON.parse(readFileSync(join(CLIENT_JS, "node_modules", "@msgpack", "msgpack", "package.json"), "utf8"));
  const lock = JSON.parse(readFileSync(join(CLIENT_JS, "package-lock.json"), "utf8"));
  assert.equal(pkg.version, lock.packages["node_modules/@msgpack/msgpack"].version);
  assert.match(readFileSync(join(CLIENT_JS, "vendor", "msgpack", "VERSION"), "utf8"), new RegExp(`@msgpack/msgpack ${pkg.version} `));
  const files = vendoredFiles();
  assert.ok(files.includes("index.mjs"));
  for (const f of files) {
    const a = readFileSync(join(CLIENT_JS, "node_modules", "@msgpack", "msgpack", "dist.esm", f));
    const b = readFileSync(join(CLIENT_JS, "vendor", "msgpack", f));
    assert.ok(a.equals(b), `vendor/msgpack/${f} differs from the npm package: run npm run vendor`);
  }
  const license = readFileSync(join(CLIENT_JS, "vendor", "msgpack", "LICENSE"));
  assert.ok(license.equals(readFileSync(join(CLIENT_JS, "node_modules", "@msgpack", "msgpack", "LICENSE"))));
});

test("the browser entry's vendored msgpack gives the same bytes for every vector", async () => {
  const vendored = await import("../vendor/msgpack/index.mjs");
  assert.notEqual(vendored.Encoder, msgpack.Encoder); // really the vendored copy
  const codec = createCodecWith("tokenwire.v1.msgpack", vendored);
  for (const v of VECTORS.valid) {
    const frame = v.direction === "client" ? frames.toWire(v.frame) : v.frame;
    assert.equal(toHex(codec.encode(frame)), v.msgpack_hex, v.name);
    assert.deepEqual(codec.decode(fromHex(v.msgpack_hex)), v.frame, v.name);
  }
});

test("penalties are sent as floats in the Python key order, and refused outside their ranges", () => {
  const f = frames.chat({
    id: "r", content: "x",
    params: { presence_penalty: 0.5, repetition_penalty: 1.2, max_tokens: 4, frequency_penalty: -1 },
  });
  assert.equal(
    JSON_.encode(f),
    '{"type":"chat","id":"r","content":"x","params":{"max_tokens":4,"repetition_penalty":1.2,"frequency_penalty":-1.0,"presence_penalty":0.5}}',
  );
  assert.throws(() => frames.chat({ id: "r", content: "x", params: { repetition_penalty: 0 } }), /repetition_penalty/);
  assert.throws(() => frames.chat({ id: "r", content: "x", params: { repetition_penalty: 2.5 } }), /repetition_penalty/);
  assert.throws(() => frames.chat({ id: "r", content: "x", params: { frequency_penalty: -2.1 } }), /frequency_penalty/);
  assert.throws(() => frames.chat({ id: "r", content: "x", params: { presence_penalty: "1" } }), /presence_penalty/);
});
