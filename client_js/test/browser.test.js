// The chat UI in headless Chromium (playwright-core driving the Debian chromium; `make js-deps` installs
// both). Against the real `tokenwire serve` (tiny model), through a TCP proxy the test can cut: ask,
// watch the reply stream in, cut the connection mid-reply, watch the indicator go to reconnecting and
// back, and the reply complete with exactly the text the server generated; stop a reply with the
// button; save a screenshot. Then model output carrying HTML is shown as text, never executed (a fake
// protocol server scripts that output, since the tiny model cannot be made to say it).
import assert from "node:assert/strict";
import { existsSync, mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import WebSocket from "ws";

import { MemoryStorage, TokenwireClient } from "../src/index.js";
import { FakeServer } from "../testing/fake-server.js";
import { Proxy } from "../testing/proxy.js";
import { findLongReply } from "../testing/replies.js";
import { ARTIFACTS, CLIENT_JS, startServer } from "../testing/server.js";

const CHROMIUM = process.env.TOKENWIRE_CHROMIUM || "/usr/bin/chromium";
const ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"];

let browser;
let server;
let proxy;

before(async () => {
  if (!existsSync(CHROMIUM)) throw new Error(`Chromium is not installed at ${CHROMIUM}: run \`make js-deps\` (apt-get install -y chromium)`);
  if (!existsSync(join(CLIENT_JS, "node_modules", "playwright-core"))) throw new Error("client_js/node_modules is missing: run `make js-deps`");
  const { chromium } = await import("playwright-core");
  [browser, server] = await Promise.all([chromium.launch({ executablePath: CHROMIUM, args: ARGS, headless: true }), startServer()]);
  proxy = await new Proxy(server.port).start();
  mkdirSync(ARTIFACTS, { recursive: true });
});

after(async () => {
  await browser?.close();
  await proxy?.close();
  if (server) await server.stop();
});

/** A fresh page that records errors, dialogs and the client's connection states. */
async function openUI(url) {
  const context = await browser.newContext({ viewport: { width: 1000, height: 900 } });
  const page = await context.newPage();
  const problems = [];
  const dialogs = [];
  page.on("pageerror", (err) => problems.push(`pageerror: ${err.message}`));
  page.on("console", (msg) => {
    // Failed reconnect attempts while the server is unreachable are expected console noise.
    if (msg.type() === "error" && !/WebSocket connection to|net::ERR_|Failed to load resource/.test(msg.text())) problems.push(`console: ${msg.text()}`);
  });
  page.on("dialog", (d) => {
    dialogs.push(d.message());
    d.dismiss().catch(() => {});
  });
  await page.goto(url);
  await page.waitForSelector('#status[data-state="open"]', { timeout: 15_000 });
  await page.evaluate(() => {
    window.__states = [];
    window.tokenwireUI.client.on("state", (e) => window.__states.push(e.state));
  });
  return { context, page, problems, dialogs };
}

async function setSettings(page, { temperature, maxTokens, seed }) {
  await page.click("#settings summary");
  await page.fill("#temperature", String(temperature));
  await page.fill("#max-tokens", String(maxTokens));
  await page.fill("#seed", String(seed));
  // A repeated seeded request would be answered from the response cache at once: nothing to cut.
  await page.uncheck("#cache");
  await page.click("#settings summary");
}

async function ask(page, text) {
  await page.fill("#prompt", text);
  await page.click("#send");
  const n = await page.locator(".turn.assistant").count();
  const turn = page.locator(".turn.assistant").nth(n - 1);
  // Streaming text appears (the cursor is shown while data-status is "streaming").
  await page.waitForFunction((i) => {
    const el = document.querySelectorAll(".turn.assistant")[i];
    return el && el.dataset.status === "streaming" && el.querySelector(".content").textContent.length > 0;
  }, n - 1);
  return turn;
}

async function lastTurn(page) {
  return page.evaluate(() => window.tokenwireUI.turns.at(-1));
}

/** The server's own record of a request, replayed from offset 0 with the page's session token. */
async function serverLog(page, id) {
  const token = await page.evaluate(() => window.tokenwireUI.client.sessionToken);
  const storage = new MemoryStorage();
  storage.setItem("k", token);
  const c = new TokenwireClient(server.url, { WebSocket, storage, storageKey: "k" });
  try {
    return await c.resume(id).result;
  } finally {
    c.close();
  }
}

test("chat UI: streams, survives a cut connection without duplicating text, stops on the button", async () => {
  const question = "Tell me a long story about tokens";
  // A seed whose reply runs to max_tokens; the uninterrupted reply is what the UI must end up showing.
  const { params, result: expected } = await findLongReply(server.url, [{ role: "user", content: question }], { temperature: 1, max_tokens: 450, cache: false });
  const { context, page, problems, dialogs } = await openUI(`${proxy.origin}/`);
  await setSettings(page, { temperature: 1, maxTokens: 450, seed: params.seed });

  // 1. Ask; text streams in.
  const turn = await ask(page, question);
  const before = (await turn.locator(".content").textContent()).length;
  assert.ok(before > 0);

  // 2. Cut the connection mid-reply and keep the server unreachable for a moment.
  proxy.refuse(1500);
  assert.ok(proxy.cut() >= 1);
  assert.equal(await turn.getAttribute("data-status"), "streaming", "the reply was still streaming when cut");
  await page.waitForSelector('#status[data-state="reconnecting"]', { timeout: 2000 });
  assert.match(await page.textContent("#status-text"), /Reconnecting/);
  await page.waitForSelector('#status[data-state="open"]', { timeout: 15_000 });
  await page.waitForFunction(() => document.querySelector(".turn.assistant").dataset.status === "done", null, { timeout: 30_000 });
  const states = await page.evaluate(() => window.__states);
  assert.ok(states.indexOf("reconnecting") >= 0 && states.lastIndexOf("open") > states.indexOf("reconnecting"), states.join(","));

  // The reply is complete and exactly what the model generates uninterrupted (greedy decoding), which
  // is also what the server logged: nothing duplicated, nothing missing.
  const reply = await lastTurn(page);
  assert.equal(reply.content, expected.text);
  const logged = await serverLog(page, reply.id);
  assert.equal(logged.text, reply.content);
  assert.equal(await turn.getAttribute("data-request-id"), reply.id);
  assert.ok((await turn.locator(".content").textContent()).length > before);

  // 3. Another question; stop it with the button.
  const second = await ask(page, "And now a short one");
  assert.equal(await page.isVisible("#stop"), true);
  await page.click("#stop");
  await page.waitForFunction(() => [...document.querySelectorAll(".turn.assistant")].at(-1).dataset.status === "cancelled", null, { timeout: 10_000 });
  assert.equal(await second.locator(".note").textContent(), "stopped");
  assert.equal(await page.isVisible("#stop"), false);
  assert.equal(await page.isEnabled("#send"), true);
  const stopped = await lastTurn(page);
  const stoppedLog = await serverLog(page, stopped.id);
  assert.equal(stoppedLog.finishReason, "cancelled");
  assert.ok(stoppedLog.offset < 450, "stopped before max_tokens");
  assert.equal(stopped.content, stoppedLog.text);

  // 4. The finished conversation, as a test artifact.
  assert.equal(await page.locator(".turn").count(), 4);
  const path = join(ARTIFACTS, "chat-ui.png");
  await page.screenshot({ path, fullPage: true });
  assert.ok(readFileSync(path).subarray(0, 8).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])));
  console.log(`screenshot: ${path}`);

  assert.deepEqual(problems, []);
  assert.deepEqual(dialogs, []);
  await context.close();
});

const HOSTILE = [
  "Here is **bold**, *italic*, `inline <code>` and a [safe link](https://example.com/docs).",
  "",
  "<img src=x onerror=alert(1)>",
  "<script>alert(2)</script><b onclick=\"document.body.dataset.pwned=1\">not bold</b>",
  "<img src=x onerror=\"document.body.dataset.pwned=2\">",
  "[click me](javascript:alert(3)) and ![pic](x onerror=alert(4))",
  "",
  "- item <i>one</i>",
  "- item two",
  "",
  "```html",
  "<iframe src=javascript:alert(5)></iframe>",
  "```",
].join("\n");

test("model output with HTML is shown as text, never executed (Markdown still rendered)", async () => {
  // Tokens of 3 characters: the tags arrive split across deltas, the hard case for naive renderers.
  const tokens = HOSTILE.match(/[\s\S]{1,3}/g);
  const fake = await new FakeServer({ reply: () => tokens, delayMs: 2 }).start();
  try {
    const { context, page, problems, dialogs } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`);
    await page.fill("#prompt", "Say something dangerous");
    await page.click("#send");
    await page.waitForFunction(() => document.querySelector(".turn.assistant")?.dataset.status === "done", null, { timeout: 15_000 });
    assert.equal((await lastTurn(page)).content, HOSTILE, "the UI received the whole scripted reply");
    const dom = await page.evaluate(() => {
      const conv = document.getElementById("conversation");
      const all = [...conv.querySelectorAll("*")];
      return {
        text: conv.querySelector(".turn.assistant .content").textContent,
        tags: [...new Set(all.map((e) => e.tagName.toLowerCase()))].sort(),
        handlers: all.flatMap((e) => [...e.attributes].map((a) => a.name)).filter((n) => n.startsWith("on")),
        links: [...conv.querySelectorAll("a")].map((a) => ({ href: a.getAttribute("href"), rel: a.rel, text: a.textContent })),
        pwned: document.body.dataset.pwned ?? null,
        strong: conv.querySelector("strong")?.textContent,
        em: conv.querySelector("em")?.textContent,
        code: [...conv.querySelectorAll("code")].map((c) => c.textContent),
        items: [...conv.querySelectorAll("li")].map((li) => li.textContent),
      };
    });
    for (const tag of ["img", "script", "iframe", "b", "i"]) assert.ok(!dom.tags.includes(tag), `a <${tag}> element reached the DOM`);
    assert.deepEqual(dom.handlers, []);
    assert.equal(dom.pwned, null);
    assert.deepEqual(dialogs, [], "no alert fired");
    // The markup is visible as the literal characters the model produced.
    for (const literal of ["<img src=x onerror=alert(1)>", "<script>alert(2)</script>", '<b onclick="document.body.dataset.pwned=1">not bold</b>', "[click me](javascript:alert(3))", "<iframe src=javascript:alert(5)></iframe>"]) {
      assert.ok(dom.text.includes(literal), `${literal} shown as text`);
    }
    // ... and the Markdown around it is rendered.
    assert.equal(dom.strong, "bold");
    assert.equal(dom.em, "italic");
    assert.deepEqual(dom.code, ["inline <code>", "<iframe src=javascript:alert(5)></iframe>"]);
    assert.deepEqual(dom.items, ["item <i>one</i>", "item two"]);
    assert.deepEqual(dom.links, [{ href: "https://example.com/docs", rel: "noopener noreferrer nofollow", text: "safe link" }]);
    const visible = await page.locator(".turn.assistant .content").innerText();
    assert.ok(visible.includes("<img src=x onerror=alert(1)>"), "visible on screen");
    const path = join(ARTIFACTS, "chat-ui-xss.png");
    await page.screenshot({ path, fullPage: true });
    console.log(`screenshot: ${path}`);
    assert.deepEqual(problems, []);
    await context.close();
  } finally {
    await fake.close();
  }
});
