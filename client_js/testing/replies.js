// Finding a reply worth interrupting. The tiny model is random: greedy decoding gives one repeated
// token, and sampling can hit end-of-sequence early. Sampling with a fixed seed is reproducible
// (same seed, same text), so the tests look for a seed whose reply runs to max_tokens, and use the
// uninterrupted reply for that seed as the reference an interrupted stream must equal.
import WebSocket from "ws";

import { MemoryStorage, TokenwireClient } from "../src/index.js";

export async function findLongReply(url, messages, params, { seeds = 16 } = {}) {
  const client = new TokenwireClient(url, { WebSocket, storage: new MemoryStorage() });
  try {
    for (let seed = 1; seed <= seeds; seed++) {
      const result = await client.chat(messages, { ...params, seed }).result;
      if (result.finishReason === "length" && new Set(result.text).size >= 10) return { seed, params: { ...params, seed }, result };
    }
  } finally {
    client.close();
  }
  throw new Error(`no seed in 1..${seeds} gives a reply of ${params.max_tokens} tokens`);
}
