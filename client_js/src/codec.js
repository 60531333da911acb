// The two encodings of protocol v1 (SPEC §2.1), byte-for-byte the same as the Python codecs.
//
// JavaScript has one number type, so two things the wire distinguishes need help:
//  * a float whose value is integral (temperature 2.0) is written as a float only when wrapped in
//    WireFloat (frames.js does this for the float-typed fields temperature and top_p);
//  * integers beyond 2^53 (a seed up to 2^63-1) are BigInt; decoders give BigInt only for such values.
// The msgpack implementation (@msgpack/msgpack) is passed in, so the same code runs in Node (npm package)
// and in a browser without a bundler (the vendored ESM build).

export const MSGPACK_SUBPROTOCOL = "tokenwire.v1.msgpack";
export const JSON_SUBPROTOCOL = "tokenwire.v1.json";
export const SUBPROTOCOLS = Object.freeze([MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL]);

/** A number that goes on the wire as a float even when its value is integral. */
export class WireFloat {
  constructor(value) {
    if (typeof value !== "number" || !Number.isFinite(value)) {
      throw new TypeError(`WireFloat: expected a finite number, got ${value}`);
    }
    this.value = value;
  }
}

/** Raised for a message that does not decode to exactly one frame map. */
export class CodecError extends Error {
  constructor(message) {
    super(message);
    this.name = "CodecError";
  }
}

// ------------------------------------------------------------------------------------------------
// JSON

/** Python's repr(float): the shortest round-trip digits, fixed notation for 1e-4 <= |x| < 1e16. */
export function pythonFloatRepr(x) {
  if (!Number.isFinite(x)) throw new TypeError(`non-finite number ${x} is not valid JSON`);
  if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
  const sign = x < 0 ? "-" : "";
  const [mant, expStr] = Math.abs(x).toExponential().split("e");
  const exp = Number(expStr);
  const digits = mant.replace(".", "");
  if (exp < -4 || exp >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    const e = Math.abs(exp).toString().padStart(2, "0");
    return `${sign}${m}e${exp < 0 ? "-" : "+"}${e}`;
  }
  if (exp < 0) return `${sign}0.${"0".repeat(-exp - 1)}${digits}`;
  const intPart = digits.slice(0, exp + 1).padEnd(exp + 1, "0");
  const frac = digits.slice(exp + 1) || "0";
  return `${sign}${intPart}.${frac}`;
}

/** JSON text as Python's json.dumps(separators=(",", ":"), ensure_ascii=False) writes it. */
export function jsonEncode(value) {
  const out = [];
  write(value, out);
  return out.join("");
}

function write(v, out) {
  if (v === null) out.push("null");
  else if (v === true) out.push("true");
  else if (v === false) out.push("false");
  else if (typeof v === "string") out.push(JSON.stringify(v));
  else if (typeof v === "number") {
    if (!Number.isFinite(v)) throw new TypeError(`non-finite number ${v} is not valid JSON`);
    out.push(Number.isInteger(v) ? intString(v) : pythonFloatRepr(v));
  } else if (typeof v === "bigint") out.push(v.toString());
  else if (v instanceof WireFloat) out.push(pythonFloatRepr(v.value));
  else if (Array.isArray(v)) {
    out.push("[");
    v.forEach((item, i) => {
      if (i) out.push(",");
      write(item === undefined ? null : item, out);
    });
    out.push("]");
  } else if (typeof v === "object") {
    out.push("{");
    let first = true;
    for (const [k, item] of Object.entries(v)) {
      if (item === undefined) continue;
      if (!first) out.push(",");
      first = false;
      out.push(JSON.stringify(k), ":");
      write(item, out);
    }
    out.push("}");
  } else {
    throw new TypeError(`cannot encode ${typeof v} as JSON`);
  }
}

function intString(v) {
  // Number#toString switches to exponent notation at 1e21; integers are written in full.
  return Math.abs(v) < 1e21 ? String(v) : BigInt(v).toString();
}

/** Parse one JSON value. Integers beyond 2^53 come back as BigInt; NaN/Infinity and garbage throw. */
export function jsonDecode(text) {
  let unsafe = false;
  let value;
  try {
    value = JSON.parse(text, (_k, v) => {
      if (typeof v === "number" && (!Number.isFinite(v) || (Number.isInteger(v) && !Number.isSafeInteger(v)))) {
        unsafe = true;
      }
      return v;
    });
  } catch (err) {
    throw new CodecError(`invalid JSON: ${err.message}`);
  }
  // Rare (a seed or timestamp past 2^53, or an overflowing literal): parse again, exactly.
  return unsafe ? new ExactJsonParser(text).parseDocument() : value;
}

const NUMBER = /-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/y;

class ExactJsonParser {
  constructor(text) {
    this.s = text;
    this.i = 0;
  }

  parseDocument() {
    const v = this.value();
    this.ws();
    if (this.i !== this.s.length) this.fail("trailing data");
    return v;
  }

  fail(what) {
    throw new CodecError(`invalid JSON: ${what} at position ${this.i}`);
  }

  ws() {
    while (this.i < this.s.length && " \t\n\r".includes(this.s[this.i])) this.i++;
  }

  value() {
    this.ws();
    const c = this.s[this.i];
    if (c === "{") return this.object();
    if (c === "[") return this.array();
    if (c === '"') return this.string();
    for (const [word, v] of [["true", true], ["false", false], ["null", null]]) {
      if (this.s.startsWith(word, this.i)) {
        this.i += word.length;
        return v;
      }
    }
    NUMBER.lastIndex = this.i;
    const m = NUMBER.exec(this.s);
    if (!m) this.fail("unexpected character");
    this.i += m[0].length;
    if (m[1] === undefined && m[2] === undefined) {
      const n = Number(m[0]);
      return Number.isSafeInteger(n) ? n : BigInt(m[0]);
    }
    const f = Number(m[0]);
    if (!Number.isFinite(f)) this.fail("number out of range");
    return f;
  }

  string() {
    // Find the closing quote (skipping escapes) and let JSON.parse decode the literal.
    const start = this.i++;
    while (this.i < this.s.length && this.s[this.i] !== '"') this.i += this.s[this.i] === "\\" ? 2 : 1;
    if (this.i >= this.s.length) this.fail("unterminated string");
    this.i++;
    try {
      return JSON.parse(this.s.slice(start, this.i));
    } catch {
      return this.fail("bad string");
    }
  }

  array() {
    this.i++;
    const out = [];
    this.ws();
    if (this.s[this.i] === "]") {
      this.i++;
      return out;
    }
    for (;;) {
      out.push(this.value());
      this.ws();
      const c = this.s[this.i++];
      if (c === "]") return out;
      if (c !== ",") this.fail("expected , or ]");
    }
  }

  object() {
    this.i++;
    const out = {};
    this.ws();
    if (this.s[this.i] === "}") {
      this.i++;
      return out;
    }
    for (;;) {
      this.ws();
      if (this.s[this.i] !== '"') this.fail("expected a key");
      const k = this.string();
      this.ws();
      if (this.s[this.i++] !== ":") this.fail("expected :");
      Object.defineProperty(out, k, { value: this.value(), enumerable: true, writable: true, configurable: true });
      this.ws();
      const c = this.s[this.i++];
      if (c === "}") return out;
      if (c !== ",") this.fail("expected , or }");
    }
  }
}

// ------------------------------------------------------------------------------------------------
// msgpack

/** Encoding and decoding with @msgpack/msgpack under the SPEC's rules (str, never bin; no ext). */
export class MsgpackCodec {
  constructor(msgpack) {
    if (!msgpack || typeof msgpack.Encoder !== "function" || typeof msgpack.Decoder !== "function") {
      throw new TypeError("MsgpackCodec needs the @msgpack/msgpack module (Encoder, Decoder)");
    }
    this.plain = new msgpack.Encoder();
    this.float = new msgpack.Encoder({ forceIntegerToFloat: true });
    this.big = new msgpack.Encoder({ useBigInt64: true });
    this.decoder = new msgpack.Decoder({ useBigInt64: true });
  }

  /** Encode a value to a Uint8Array; map keys keep their insertion order. */
  encode(value) {
    const chunks = [];
    this.#write(value, chunks);
    if (chunks.length === 1) return chunks[0];
    let size = 0;
    for (const c of chunks) size += c.length;
    const out = new Uint8Array(size);
    let pos = 0;
    for (const c of chunks) {
      out.set(c, pos);
      pos += c.length;
    }
    return out;
  }

  #write(v, chunks) {
    // Maps and arrays are framed here so that leaves can be written by three differently configured
    // encoders: plain numbers as Python writes them (ints up to uint64 as ints), WireFloat as float64,
    // BigInt as (u)int64. (One encoder with useBigInt64 would write safe integers past 2^32 as floats.)
    if (v instanceof WireFloat) chunks.push(this.float.encode(v.value));
    else if (typeof v === "bigint") chunks.push(this.big.encode(v));
    else if (Array.isArray(v)) {
      chunks.push(header(v.length, 0x90, 0xdc));
      for (const item of v) this.#write(item === undefined ? null : item, chunks);
    } else if (v !== null && typeof v === "object" && !(v instanceof Uint8Array)) {
      const entries = Object.entries(v).filter(([, item]) => item !== undefined);
      chunks.push(header(entries.length, 0x80, 0xde));
      for (const [k, item] of entries) {
        chunks.push(this.plain.encode(k));
        this.#write(item, chunks);
      }
    } else {
      if (typeof v === "number" && !Number.isFinite(v)) throw new TypeError(`non-finite number ${v}`);
      chunks.push(this.plain.encode(v));
    }
  }

  /** Decode exactly one msgpack value; integers beyond 2^53 come back as BigInt. */
  decode(bytes) {
    let value;
    try {
      value = this.decoder.decode(bytes);
    } catch (err) {
      throw new CodecError(`invalid msgpack: ${err.message}`);
    }
    return unbig(value);
  }
}

function header(n, fix, wide) {
  if (n < 16) return Uint8Array.of(fix | n);
  if (n < 0x10000) return Uint8Array.of(wide, n >> 8, n & 0xff);
  return Uint8Array.of(wide + 1, (n >>> 24) & 0xff, (n >>> 16) & 0xff, (n >>> 8) & 0xff, n & 0xff);
}

function unbig(v) {
  if (typeof v === "bigint") {
    return v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;
  }
  if (Array.isArray(v)) {
    for (let i = 0; i < v.length; i++) v[i] = unbig(v[i]);
  } else if (v !== null && typeof v === "object" && !(v instanceof Uint8Array)) {
    for (const k of Object.keys(v)) v[k] = unbig(v[k]);
  }
  return v;
}

// ------------------------------------------------------------------------------------------------
// per-subprotocol codec

/**
 * The codec of one subprotocol: `encode(frame)` gives what to pass to WebSocket#send (Uint8Array for
 * msgpack, string for JSON); `decode(data)` takes a message (ArrayBuffer/Uint8Array or string) and
 * returns the frame map, or throws CodecError.
 */
export function createCodec(subprotocol, msgpack = null) {
  if (subprotocol === MSGPACK_SUBPROTOCOL) {
    const mp = new MsgpackCodec(msgpack);
    return {
      subprotocol,
      binary: true,
      encode: (frame) => mp.encode(frame),
      decode(data) {
        if (typeof data === "string") throw new CodecError(`text message on ${MSGPACK_SUBPROTOCOL}`);
        const bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
        return checkMap(mp.decode(bytes));
      },
    };
  }
  if (subprotocol === JSON_SUBPROTOCOL) {
    return {
      subprotocol,
      binary: false,
      encode: (frame) => jsonEncode(frame),
      decode(data) {
        if (typeof data !== "string") throw new CodecError(`binary message on ${JSON_SUBPROTOCOL}`);
        return checkMap(jsonDecode(data));
      },
    };
  }
  throw new TypeError(`unknown subprotocol ${subprotocol}; expected one of ${SUBPROTOCOLS.join(", ")}`);
}

function checkMap(v) {
  if (v === null || typeof v !== "object" || Array.isArray(v) || v instanceof Uint8Array) {
    throw new CodecError("a frame must be a map with a 'type' key");
  }
  if (typeof v.type !== "string") throw new CodecError("a frame must have a string 'type'");
  return v;
}

/** Hex of bytes, and bytes of hex: for tests and debugging. */
export function toHex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export function fromHex(hex) {
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}
