// The chat UI says what a frozen reply waits for (issue 29), in headless Chromium against a real cluster:
// `tokenwire gateway` and `tokenwire worker` processes (tiny model) over one store, the page reached
// through a TCP proxy. Each frozen moment is made by the test, not by timing: no worker is running at all
// while the UI must say the model is loading; the worker is frozen (SIGSTOP) at the reply's first token
// and killed, and the gateway restarted, while the UI must say the reply waits for the server; tokens
// flow again only once the test starts a worker, and then the waiting line and header text go.
import assert from "node:assert/strict";
import { existsSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Proxy } from "../testing/proxy.js";
import { findLongReply } from "../testing/replies.js";
import { ARTIFACTS, CLIENT_JS, newStoreScope, startGateway, startStore, startWorker } from "../testing/server.js";

const CHROMIUM = process.env.TOKENWIRE_CHROMIUM || "/usr/bin/chromium";
const ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"];
const PHONE = { viewport: { width: 390, height: 844 }, deviceScaleFactor: 2, isMobile: true, hasTouch: true };
// Short leases: a killed worker's reply goes back to the queue 3 s after its last heartbeat.
const LEASE = ["--lease-ttl", "3"];

let browser;
let store;
let proxy;
const procs = [];

before(async () => {
  if (!existsSync(CHROMIUM)) throw new Error(`Chromium is not installed at ${CHROMIUM}: run \`make js-deps\` (apt-get install -y chromium)`);
  if (!existsSync(join(CLIENT_JS, "node_modules", "playwright-core"))) throw new Error("client_js/node_modules is missing: run `make js-deps`");
  const { chromium } = await import("playwright-core");
  [browser, store] = await Promise.all([chromium.launch({ executablePath: CHROMIUM, args: ARGS, headless: true }), startStore()]);
  mkdirSync(ARTIFACTS, { recursive: true });
});

after(async () => {
  await browser?.close();
  await proxy?.close();
  for (const p of procs) await p.kill();
  await store?.stop();
});

/** What the page shows about the streaming reply: its waiting line and the header's status. */
const shown = (page) =>
  page.evaluate(() => {
    const turn = [...document.querySelectorAll(".turn.assistant")].at(-1);
    const status = document.getElementById("status");
    return {
      wait: turn?.dataset.wait ?? null,
      line: turn?.querySelector(".wait").textContent ?? "",
      lineVisible: turn ? turn.querySelector(".wait").getBoundingClientRect().height > 0 : false,
      state: status.dataset.state,
      statusText: document.getElementById("status-text").textContent,
      status: turn?.dataset.status ?? null,
    };
  });

test("a reply frozen behind a loading model, or after a restart, says what it waits for; tokens clear it", async (t) => {
  const scope = newStoreScope();
  let gateway = await startGateway({ store, scope, extraArgs: LEASE });
  procs.push(gateway);
  proxy = await new Proxy(gateway.port).start();
  const context = await browser.newContext(PHONE);
  const page = await context.newPage();
  const problems = [];
  page.on("pageerror", (err) => problems.push(`pageerror: ${err.message}`));
  // Which worker the reply's first token came from is decided here: freeze it at once (SIGSTOP).
  let freeze = null;
  let frozenAt = null;
  await page.exposeFunction("firstToken", (offset) => {
    if (freeze && frozenAt === null) {
      frozenAt = offset;
      freeze();
    }
  });
  await page.goto(`${proxy.origin}/`);
  await page.waitForSelector('#status[data-state="open"]', { timeout: 15_000 });
  await page.evaluate(() => {
    const client = window.tokenwireUI.client;
    client.on("frame", (f) => {
      if (f.type === "delta") window.firstToken(f.offset + f.n);
    });
    window.__opens = 0; // connections opened after this one
    window.__resumed = []; // ids resumed in a reconnect's hello
    client.on("state", (e) => e.state === "open" && (window.__opens += 1));
    client.on("resume", (e) => window.__resumed.push(...e.points.map((p) => p.id)));
  });

  // 1. No worker serves the model yet: the welcome says so, a chat is queued, and the UI says why.
  assert.deepEqual(await page.evaluate(() => window.tokenwireUI.client.welcome.loading), ["default"]);
  await page.fill("#prompt", "Hello there");
  await page.click("#send");
  await page.waitForSelector('.turn.assistant[data-wait="loading"]', { timeout: 10_000 });
  let s = await shown(page);
  assert.match(s.line, /^Queued: the model is still loading\. This reply starts as soon as it has loaded\.$/);
  assert.ok(s.lineVisible, "the waiting line is shown in the reply");
  assert.equal(s.state, "open");
  assert.equal(s.statusText, "Model loading…", "not a plain Connected while the reply waits");
  await page.screenshot({ path: join(ARTIFACTS, "ui-waiting-model-loading-phone.png") });

  // 2. A worker comes up: the queued chat runs, the waiting line and the header's text go.
  let worker = await startWorker({ store, scope, extraArgs: LEASE });
  procs.push(worker);
  await page.waitForFunction(() => window.tokenwireUI.turns.at(-1).status === "done", null, { timeout: 30_000 });
  s = await shown(page);
  assert.deepEqual([s.wait, s.line, s.lineVisible, s.statusText], [null, "", false, "Connected"]);
  assert.ok((await page.evaluate(() => window.tokenwireUI.turns.at(-1).content)).length > 0);

  // 3. A long reply (a seed that runs to max_tokens), frozen at its first token: its worker stopped and
  //    killed, the gateway restarted. The UI reconnects and resumes it, and says it waits.
  const question = "Tell me a long story about waiting";
  const { params, result: expected } = await findLongReply(gateway.url, [{ role: "user", content: question }], { temperature: 1, max_tokens: 400, cache: false });
  await page.click("#settings-toggle");
  await page.fill("#temperature", "1");
  await page.fill("#max-tokens", "400");
  await page.fill("#seed", String(params.seed));
  await page.uncheck("#cache");
  await page.click("#settings-toggle");
  // The conversation so far is part of the request: the reference reply is for the question alone.
  await page.click("#new-chat");
  const stopped = worker;
  freeze = () => stopped.proc.kill("SIGSTOP");
  await page.fill("#prompt", question);
  await page.click("#send");
  await page.waitForFunction(() => window.tokenwireUI.turns.at(-1)?.content.length > 0, null, { timeout: 30_000 });
  assert.ok(frozenAt !== null && frozenAt < 400, `frozen mid-reply (at ${frozenAt})`);
  await stopped.kill();
  await gateway.stop();
  gateway = await startGateway({ store, scope, port: gateway.port, extraArgs: LEASE });
  procs.push(gateway);
  // Reconnected to the new gateway, which resumed the reply; then the UI says what it waits for.
  await page.waitForFunction(() => window.__opens >= 1 && window.tokenwireUI.client.state === "open", null, { timeout: 30_000 });
  const id = await page.evaluate(() => window.tokenwireUI.turns.at(-1).id);
  assert.ok((await page.evaluate(() => window.__resumed)).includes(id), "the reply was resumed in the hello");
  await page.waitForSelector(".turn.assistant[data-wait]", { timeout: 15_000 });
  s = await shown(page);
  assert.equal(s.status, "streaming");
  // Waiting for the server to resume it: the model loading (no worker left once the dead one's lease
  // lapsed) or, while that lease still runs, the resume itself.
  const waits = {
    loading: ["Model loading…", /^Queued: the model is still loading\. This reply continues as soon as it has loaded\.$/],
    resume: ["Resuming reply…", /^Waiting for the server to resume this reply…$/],
  };
  assert.ok(s.wait in waits, `waits for ${s.wait}`);
  const waited = s.wait;
  assert.equal(s.statusText, waits[s.wait][0]);
  assert.match(s.line, waits[s.wait][1]);
  assert.ok(s.lineVisible);
  await page.screenshot({ path: join(ARTIFACTS, "ui-waiting-after-restart-phone.png") });
  const held = (await page.evaluate(() => window.tokenwireUI.turns.at(-1).content)).length;
  assert.ok(held > 0 && held < expected.text.length, "the reply is frozen part-way");

  // 4. A new worker takes the reply over after the logged tokens: tokens flow, the waiting goes, and
  //    the reply ends exactly as an uninterrupted run.
  worker = await startWorker({ store, scope, extraArgs: LEASE });
  procs.push(worker);
  await page.waitForFunction((n) => window.tokenwireUI.turns.at(-1).content.length > n, held, { timeout: 30_000 });
  s = await shown(page);
  assert.equal(s.wait, null, "tokens flow: no longer waiting");
  assert.notEqual(s.statusText, waits.loading[0]);
  assert.notEqual(s.statusText, waits.resume[0]);
  await page.waitForFunction(() => window.tokenwireUI.turns.at(-1).status === "done", null, { timeout: 30_000 });
  const reply = await page.evaluate(() => window.tokenwireUI.turns.at(-1));
  assert.equal(reply.content, expected.text, "nothing lost, nothing repeated");
  s = await shown(page);
  assert.deepEqual([s.wait, s.line, s.statusText], [null, "", "Connected"]);
  assert.deepEqual(problems, []);
  t.diagnostic(`seed ${params.seed}: frozen at token ${frozenAt}, ${held} characters shown while waiting for ${waited}`);
  await context.close();
});
