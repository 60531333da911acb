// A server restart survived: `tokenwire serve` stops mid-stream (SIGTERM: connections closed with 1012),
// a new process starts on the same port and store; the client reconnects by itself, resumes, and ends
// with exactly the reply an uninterrupted run gives. The new process takes the request over once the
// old worker's lease lapses (about 10 s), continuing after the tokens already logged.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import WebSocket from "ws";

import { MemoryStorage, TokenwireClient } from "../src/index.js";
import { findLongReply } from "../testing/replies.js";
import { newStoreScope, startServer } from "../testing/server.js";

const servers = [];
let client;

after(async () => {
  client?.close();
  for (const s of servers) await s.stop();
});

test("a server restart mid-stream: reconnect, resume, same text, no gap, no repeat", async (t) => {
  const scope = newStoreScope();
  const first = await startServer({ scope });
  servers.push(first);
  const messages = [{ role: "user", content: "Tell me a long story about restarts" }];
  // The reply an uninterrupted run gives for a seed that runs to max_tokens (same seed, same text).
  const { params, result: expected } = await findLongReply(first.url, messages, { temperature: 1, max_tokens: 400, cache: false });

  client = new TokenwireClient(first.url, { WebSocket, storage: new MemoryStorage(), backoff: { initialMs: 100, maxMs: 800 } });
  const states = [];
  const resumes = [];
  client.on("state", (ev) => states.push(ev));
  client.on("resume", (ev) => resumes.push(ev.points));
  const stream = client.chat(messages, params);
  let stoppedAt = null;
  let restarted = null;
  let text = "";
  let pos = 0;
  for await (const item of stream) {
    assert.equal(item.type, "delta", "no reset: the log continued under the same epoch");
    assert.equal(item.offset, pos, "contiguous offsets");
    pos += item.n;
    text += item.text;
    if (stoppedAt === null && pos >= 10) {
      stoppedAt = pos;
      // Stop the server while the reply streams, then start a new one on the same port and store.
      // SIGSTOP first pins the moment: generation halts here, and the SIGTERM is handled on SIGCONT.
      first.proc.kill("SIGSTOP");
      const stopping = first.stop();
      first.proc.kill("SIGCONT");
      restarted = stopping.then(async ({ code }) => {
        assert.equal(code, 0);
        const second = await startServer({ scope, port: first.port });
        servers.push(second);
        return second;
      });
    }
  }
  const result = await stream.result;
  await restarted;
  assert.ok(stoppedAt < 400, "stopped mid-stream");
  assert.equal(result.offset, expected.offset);
  assert.equal(result.offset, pos);
  assert.equal(text, expected.text, "the same text as an uninterrupted run");
  assert.equal(result.text, expected.text);
  const lost = states.find((s) => s.state === "reconnecting");
  assert.equal(lost.code, 1012, "the server said it was restarting");
  assert.equal(states.at(-1).state, "open");
  // The client resumed the request in its hello, from the offset it held, with its epoch.
  const point = resumes.at(-1).find((p) => p.id === stream.id);
  assert.ok(point.offset >= stoppedAt && point.offset < 400);
  assert.equal(point.epoch, 1);
  t.diagnostic(`seed ${params.seed}: stopped at token ${stoppedAt}, resumed at ${point.offset} of ${result.offset}`);
});
