// The chat UI in headless Chromium (playwright-core driving the Debian chromium; `make js-deps` installs
// both). Against the real `tokenwire serve` (tiny model), through a TCP proxy the test can cut: ask,
// watch the reply stream in, cut the connection mid-reply, watch the indicator go to reconnecting and
// back, and the reply complete with exactly the text the server generated. A fake protocol server (which
// the real server lists with --ui-connect, so the UI may use it through ?ws=) scripts what the tiny model
// cannot be made to do on demand: a reply that never ends by itself (the Stop button's reply cannot
// finish before the click), model output carrying HTML (shown as text, never executed), Markdown with
// code, replies cut at `length` by each limit. A second fake, not listed, is refused: a crafted ?ws=
// link sends it nothing. Screenshots of a desktop and a 390x844 phone (empty state, streaming reply,
// settings open, server unreachable) are saved under test-artifacts/.
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
let fake; // scripted replies, listed by the server (--ui-connect)
let evil; // not listed: the UI must refuse it

const ENDLESS = Array.from({ length: 5000 }, (_, i) => (i % 12 === 11 ? ".\n\n" : ` word${i}`));
const CODE_REPLY = ["Here is a function that reverses a string:\n\n", "```python\n", "def reverse(s: str) -> str:\n", "    return s[::-1]\n", "```\n\n", "It uses", " slicing", " with a", " step of", " -1."];
// What the fake says, by the question asked (the last user message).
const SCRIPT = {
  "Keep talking": { reply: ENDLESS, holdAt: 40 },
  "Keep talking, then go away": { reply: ENDLESS, holdAt: 20 },
  "Reverse a string in Python": { reply: CODE_REPLY },
  "Reverse a string, slowly": { reply: CODE_REPLY, holdAt: 7 },
  "A long answer please": { reply: ENDLESS.slice(0, 30), finish: "length", lengthReason: "max_tokens" }, // asked with Max tokens 30
  // Cut at `length` well before the max_tokens asked (256): the model's context window filled up, as the
  // server says, or as the page guesses when a server before length_reason says nothing.
  "Go on with our very long conversation": { reply: ENDLESS.slice(0, 12), finish: "length", lengthReason: "context" },
  "Go on, older server": { reply: ENDLESS.slice(0, 12), finish: "length" },
  // Asked with Max tokens 30: the window filled at the 30th token too, and the server says context (SPEC §12).
  "Fill the window to the last token": { reply: ENDLESS.slice(0, 30), finish: "length", lengthReason: "context" },
  // Cut at 12 of the 256 asked by max_tokens: a busy server lowered it (SPEC §4.2).
  "Answer while the server is busy": { reply: ENDLESS.slice(0, 12), finish: "length", lengthReason: "max_tokens" },
  // Asked with Max tokens 30 of a server whose own cap (welcome.limits.max_tokens) is 20.
  "Answer up to this server's cap": { reply: ENDLESS.slice(0, 20), finish: "length", lengthReason: "max_tokens" },
  "Tell me everything": { reply: ENDLESS.slice(0, 400) },
};
const lastQuestion = (f) => (f.messages ? f.messages.at(-1).content : f.content);

before(async () => {
  if (!existsSync(CHROMIUM)) throw new Error(`Chromium is not installed at ${CHROMIUM}: run \`make js-deps\` (apt-get install -y chromium)`);
  if (!existsSync(join(CLIENT_JS, "node_modules", "playwright-core"))) throw new Error("client_js/node_modules is missing: run `make js-deps`");
  const { chromium } = await import("playwright-core");
  fake = await new FakeServer({
    reply: (f) => SCRIPT[lastQuestion(f)]?.reply ?? HOSTILE.match(/[\s\S]{1,3}/g),
    holdAt: (f) => SCRIPT[lastQuestion(f)]?.holdAt ?? null,
    finish: (f) => SCRIPT[lastQuestion(f)]?.finish ?? "stop",
    lengthReason: (f) => SCRIPT[lastQuestion(f)]?.lengthReason,
    delayMs: 2,
  }).start();
  evil = await new FakeServer({ reply: () => ["thanks"] }).start();
  const allowed = new URL(fake.url);
  [browser, server] = await Promise.all([
    chromium.launch({ executablePath: CHROMIUM, args: ARGS, headless: true }),
    startServer({ extraArgs: ["--ui-connect", `ws://${allowed.host}`] }),
  ]);
  proxy = await new Proxy(server.port).start();
  mkdirSync(ARTIFACTS, { recursive: true });
});

after(async () => {
  await browser?.close();
  await proxy?.close();
  await fake?.close();
  await evil?.close();
  if (server) await server.stop();
});

const DESKTOP = { viewport: { width: 1000, height: 900 } };
const PHONE = { viewport: { width: 390, height: 844 }, deviceScaleFactor: 2, isMobile: true, hasTouch: true };

// Run before the page's scripts: the backoff's jitter pinned to its top, so that each reconnect delay is
// its cap (about 0.3, 0.6, 1.2, 2.4, 4.8 s...; only the backoff uses Math.random in the UI and client).
const PINNED_BACKOFF = () => {
  Math.random = () => 0.999;
};

/** A fresh page that records errors, dialogs and the client's connection states. */
async function openUI(url, { device = DESKTOP, waitOpen = true, init = null } = {}) {
  const context = await browser.newContext(device);
  if (init) await context.addInitScript(init);
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
  if (waitOpen) {
    await page.waitForSelector('#status[data-state="open"]', { timeout: 15_000 });
    await page.evaluate(() => {
      window.__states = [];
      window.tokenwireUI.client.on("state", (e) => window.__states.push(e.state));
    });
  }
  return { context, page, problems, dialogs };
}

async function setSettings(page, { temperature, maxTokens, seed }) {
  await page.click("#settings-toggle");
  await page.fill("#temperature", String(temperature));
  await page.fill("#max-tokens", String(maxTokens));
  await page.fill("#seed", String(seed));
  // A repeated seeded request would be answered from the response cache at once: nothing to cut.
  await page.uncheck("#cache");
  await page.click("#settings-toggle");
}

async function setMaxTokens(page, maxTokens) {
  await page.click("#settings-toggle");
  await page.fill("#max-tokens", String(maxTokens));
  await page.click("#settings-toggle");
}

/**
 * Record in the page every `reconnecting` event (its delay), every `open`, and every text the banner
 * and the header show, each with its time and `attempt`: how many `reconnecting` events had come (a
 * text an event brought is seen after that event's listeners, so it carries the event's own count).
 */
async function recordRetries(page) {
  await page.evaluate(() => {
    Object.assign(window, { __retries: [], __opens: [], __banner: [], __header: [] });
    const client = window.tokenwireUI.client;
    client.on("reconnecting", (e) => window.__retries.push({ at: performance.now(), delay: e.delay ?? null }));
    client.on("open", () => window.__opens.push(performance.now()));
    const watch = (el, log, read) =>
      new MutationObserver(() => {
        const text = read(el);
        if (log.at(-1)?.text !== text) log.push({ at: performance.now(), attempt: window.__retries.length, text });
      }).observe(el, { attributes: true, childList: true, subtree: true, characterData: true });
    watch(document.getElementById("banner"), window.__banner, (el) => (el.hidden ? null : el.textContent));
    watch(document.getElementById("status-text"), window.__header, (el) => el.textContent);
  });
}

async function shot(page, name) {
  const path = join(ARTIFACTS, `${name}.png`);
  await page.screenshot({ path, fullPage: false });
  assert.ok(readFileSync(path).subarray(0, 8).equals(PNG));
  console.log(`screenshot: ${path}`);
}

const PNG = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);

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

/** Send `question`, wait for its reply (the conversation's `turns`-th turn) to end at `length`, and give its note. */
async function cutReply(page, question, turns) {
  await page.fill("#prompt", question);
  await page.click("#send");
  await page.waitForFunction((n) => window.tokenwireUI.turns.length === n && window.tokenwireUI.turns.at(-1).status === "done", turns, { timeout: 15_000 });
  assert.equal((await lastTurn(page)).finish, "length");
  return page.locator(".turn.assistant").last().locator(".note");
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

test("chat UI: streams, survives a cut connection without duplicating text", async () => {
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

  // 3. The finished conversation, as a test artifact.
  assert.equal(await page.locator(".turn").count(), 2);
  await shot(page, "chat-ui");

  assert.deepEqual(problems, []);
  assert.deepEqual(dialogs, []);
  await context.close();
});

test("Stop ends a reply that cannot finish by itself; the server is told to cancel it", async () => {
  // The fake holds this reply after 40 tokens until it is cancelled: it is still streaming whenever
  // the click lands, however slow or fast the machine.
  const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`);
  const turn = await ask(page, "Keep talking");
  assert.equal(await page.isVisible("#stop"), true);
  assert.equal(await page.isVisible("#send"), false, "Stop takes Send's place while streaming");
  await page.click("#stop");
  await page.waitForFunction(() => [...document.querySelectorAll(".turn.assistant")].at(-1).dataset.status === "cancelled", null, { timeout: 10_000 });
  assert.equal(await turn.locator(".note").textContent(), "stopped");
  assert.equal(await page.isVisible("#stop"), false);
  assert.equal(await page.isEnabled("#send"), true);
  const stopped = await lastTurn(page);
  assert.ok(fake.received.some((f) => f.type === "cancel" && f.id === stopped.id), "a cancel frame was sent");
  assert.ok(stopped.content.length > 0 && stopped.content.length < ENDLESS.join("").length);
  assert.deepEqual(problems, []);
  await context.close();
});

test("a reply the server's detach timeout ended is shown as interrupted, not stopped", async () => {
  const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`);
  const turn = await ask(page, "Keep talking, then go away");
  fake.detachTimeout((await lastTurn(page)).id); // as if nobody had been attached for the detach timeout
  await page.waitForFunction(() => [...document.querySelectorAll(".turn.assistant")].at(-1).dataset.status === "cancelled", null, { timeout: 10_000 });
  assert.equal(await turn.locator(".note").textContent(), "interrupted (the page was away too long)");
  assert.deepEqual(problems, []);
  await context.close();
});

test("a ?ws= server that this server does not list is refused with a visible message; nothing is sent", async () => {
  const { context, page, problems } = await openUI(`${server.origin}/`, { waitOpen: true });
  // A conversation kept in this browser: what a crafted link would try to ship elsewhere.
  await page.evaluate(() => localStorage.setItem("tokenwire:ui:conversation", JSON.stringify([{ role: "user", content: "my secret plans", status: "done" }, { role: "assistant", content: "noted", status: "done" }])));
  await page.goto(`${server.origin}/?ws=${encodeURIComponent(evil.url)}`);
  const banner = page.locator('#banner[data-kind="refused"]');
  await banner.waitFor({ state: "visible", timeout: 10_000 });
  const evilOrigin = `ws://${new URL(evil.url).host}`;
  assert.match(await banner.textContent(), new RegExp(`Not connecting to ${evilOrigin.replace(/[.]/g, "\\.")}.*Nothing was sent`));
  assert.equal(await page.getAttribute("#status", "data-state"), "refused");
  assert.equal(await page.isDisabled("#prompt"), true);
  assert.equal(await page.isDisabled("#send"), true);
  // Even a script on the page could not reach it: the page's CSP allows only this server and the listed one.
  const direct = await page.evaluate(
    (u) =>
      new Promise((resolve) => {
        const seen = { violation: null, opened: false };
        document.addEventListener("securitypolicyviolation", (e) => {
          seen.violation = e.effectiveDirective;
          resolve(seen);
        });
        try {
          const ws = new WebSocket(u);
          ws.onopen = () => {
            seen.opened = true;
            resolve(seen);
          };
        } catch (e) {
          seen.violation = e.name;
          resolve(seen);
        }
      }),
    evil.url,
  );
  assert.deepEqual(direct, { violation: "connect-src", opened: false });
  await page.evaluate(() => new Promise((r) => setTimeout(r, 300))); // give any stray connect a chance to show
  assert.equal(evil.connections, 0, "no connection to the unlisted server");
  assert.deepEqual(evil.received, []);
  assert.equal(await page.locator(".turn").count(), 2, "the conversation stays in this browser");
  await shot(page, "ui-refused-foreign-ws");
  assert.deepEqual(problems.filter((p) => !/Content Security Policy|violates/.test(p)), []);
  await context.close();
});

test("with several models the UI shows a picker; the chosen model is sent, kept, and named on the reply", async () => {
  const one = await openUI(`${server.origin}/`);
  assert.equal(await one.page.isHidden("#model"), true, "one model: no picker");
  await one.context.close();
  fake.models = ["big", "light"];
  try {
    const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`);
    await page.waitForSelector("#model:not([hidden])");
    assert.deepEqual(await page.locator("#model option").evaluateAll((os) => os.map((o) => o.value)), ["big", "light"]);
    assert.equal(await page.inputValue("#model"), "big", "the default first");
    await page.selectOption("#model", "light");
    await page.fill("#prompt", "Reverse a string in Python");
    await page.click("#send");
    await page.waitForFunction(() => window.tokenwireUI.turns.at(-1)?.status === "done");
    const chat = fake.received.filter((f) => f.type === "chat").at(-1);
    assert.equal(chat.params.model, "light");
    assert.equal((await lastTurn(page)).model, "light");
    assert.equal(await page.locator(".turn.assistant .who").last().textContent(), "light");
    await page.reload();
    await page.waitForSelector('#status[data-state="open"]', { timeout: 15_000 });
    await page.waitForSelector("#model:not([hidden])");
    assert.equal(await page.inputValue("#model"), "light", "the choice is kept");
    assert.equal(await page.locator(".turn.assistant .who").last().textContent(), "light");
    await shot(page, "ui-model-picker");
    assert.deepEqual(problems, []);
    await context.close();
  } finally {
    fake.models = null;
  }
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
  // Tokens of 3 characters: the tags arrive split across deltas, the hard case for naive renderers
  // (the fake's default reply).
  {
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
    await shot(page, "chat-ui-xss");
    assert.deepEqual(problems, []);
    await context.close();
  }
});

const box = (page, selector) => page.locator(selector).first().boundingBox();

for (const [name, device] of [
  ["desktop", DESKTOP],
  ["phone", PHONE],
]) {
  test(`screenshots and layout (${name}): empty state, settings, streaming reply, unreachable server`, async () => {
    const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`, { device });
    await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: server.origin });
    const width = device.viewport.width;

    // Empty state: what this is, the model's name, example prompts.
    assert.equal(await page.isVisible("#empty"), true);
    const config = await page.evaluate(() => window.tokenwireUI.config);
    assert.ok(config.model, "the server named its model");
    assert.equal(await page.textContent("#model-name"), config.model);
    assert.equal(await page.locator(".example").count(), 3);
    // The header is one line: each button's text on one line, the bar no taller than one row.
    const bar = await box(page, ".bar");
    assert.ok(bar.height <= 60, `header ${bar.height}px tall`);
    for (const sel of ["#settings-toggle", "#new-chat", "#status"]) {
      const b = await box(page, sel);
      assert.ok(b.height <= 40 && b.x + b.width <= width, `${sel} wraps or overflows: ${JSON.stringify(b)}`);
    }
    const placeholder = await page.getAttribute("#prompt", "placeholder");
    if (name === "phone") assert.doesNotMatch(placeholder, /Shift|Enter/, "no keyboard hints on a phone");
    else assert.match(placeholder, /Enter to send/);
    await shot(page, `ui-empty-${name}`);

    // Settings: the server's defaults; labels and inputs aligned; no overlap with the conversation.
    await page.click("#settings-toggle");
    await page.waitForSelector("#settings-panel:not([hidden])");
    assert.equal(Number(await page.inputValue("#temperature")), config.defaults.temperature);
    assert.equal(Number(await page.inputValue("#max-tokens")), config.defaults.max_tokens);
    const inputs = await page.locator(".settings-grid input").evaluateAll((els) => els.map((e) => Math.round(e.getBoundingClientRect().left)));
    const columns = new Set(inputs);
    assert.equal(columns.size, name === "phone" ? 1 : 2, `inputs at x = ${[...columns]}`);
    const label = await box(page, 'label[for="cache"]');
    const check = await box(page, "#cache");
    assert.ok(check.x - (label.x + label.width) < 60, "the checkbox sits next to its label");
    assert.ok(Math.abs(check.y + check.height / 2 - (label.y + label.height / 2)) < 6, "on the label's line");
    const panel = await box(page, "#settings-panel");
    assert.ok(panel.x + panel.width <= width + 1, "the panel fits the screen");
    assert.ok((await box(page, "#empty")).y >= panel.y + panel.height - 1, "the panel does not cover the conversation");
    await shot(page, `ui-settings-${name}`);
    await page.click("#settings-toggle");

    // A streaming reply (held by the fake after its code block: still streaming when shot).
    const turn = await ask(page, "Reverse a string, slowly");
    await page.waitForFunction(() => document.querySelector(".turn.assistant pre")?.textContent.includes("return s[::-1]"));
    assert.equal(await turn.getAttribute("data-status"), "streaming");
    assert.equal(await page.isVisible("#empty"), false);
    const prompt = await box(page, "#prompt");
    assert.ok(prompt.width >= width * 0.55, `the message box keeps its width while streaming (${prompt.width}px)`);
    await shot(page, `ui-streaming-${name}`);
    fake.release((await lastTurn(page)).id);
    await page.waitForFunction(() => document.querySelector(".turn.assistant").dataset.status === "done");
    // Code blocks get a copy button that copies the code.
    await page.click(".turn.assistant pre .copy");
    await page.waitForFunction(() => document.querySelector(".turn.assistant pre .copy").textContent === "Copied");
    assert.equal(await page.evaluate(() => navigator.clipboard.readText()), "def reverse(s: str) -> str:\n    return s[::-1]");

    // A reply cut at max_tokens says so in words.
    await setMaxTokens(page, 30);
    await page.fill("#prompt", "A long answer please"); // 30 quick tokens: may be done before any check
    await page.click("#send");
    await page.waitForFunction(() => document.querySelectorAll(".turn.assistant").length === 2);
    await page.waitForFunction(() => [...document.querySelectorAll(".turn.assistant")].at(-1).dataset.status === "done");
    const note = await page.locator(".turn.assistant").last().locator(".note");
    assert.match(await note.textContent(), /hit the max tokens limit \(30 tokens\) and was cut off/);
    assert.equal(await note.isVisible(), true);
    await shot(page, `ui-max-tokens-${name}`);
    assert.deepEqual(problems, []);
    await context.close();

    // The server unreachable: a banner, not only a small label.
    const cutoff = await new Proxy(server.port).start();
    try {
      const { context: c2, page: p2 } = await openUI(`${cutoff.origin}/`, { device });
      cutoff.refuse(120_000);
      cutoff.cut();
      const banner = p2.locator('#banner[data-kind="offline"]');
      await banner.waitFor({ state: "visible", timeout: 10_000 });
      assert.match(await banner.textContent(), /Can't reach the server at 127\.0\.0\.1:\d+/);
      const b = await banner.boundingBox();
      assert.ok(b.width >= width - 1 && b.height >= 30, "a full-width banner");
      await shot(p2, `ui-unreachable-${name}`);
      await c2.close();
    } finally {
      await cutoff.close();
    }
  });
}

test("phone: a reply cut at max tokens says so in the conversation, above the message box (issue 29)", async () => {
  const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`, { device: PHONE });
  // A conversation taller than the phone's screen, then a reply that the server cuts at max_tokens.
  await page.fill("#prompt", "Tell me everything");
  await page.click("#send");
  await page.waitForFunction(() => window.tokenwireUI.turns.at(-1)?.status === "done", null, { timeout: 15_000 });
  await setMaxTokens(page, 30);
  await page.fill("#prompt", "A long answer please");
  await page.click("#send");
  await page.waitForFunction(() => window.tokenwireUI.turns.length === 4 && window.tokenwireUI.turns.at(-1).status === "done", null, { timeout: 15_000 });
  const where = await page.evaluate(() => {
    const note = [...document.querySelectorAll(".turn.assistant .note")].at(-1);
    const n = note.getBoundingClientRect();
    const hit = document.elementFromPoint(n.left + n.width / 2, n.top + n.height / 2);
    return {
      text: note.textContent,
      top: n.top,
      bottom: n.bottom,
      composerTop: document.getElementById("composer").getBoundingClientRect().top,
      barBottom: document.querySelector(".bar").getBoundingClientRect().bottom,
      onTop: note.contains(hit),
      scrollable: document.scrollingElement.scrollHeight > innerHeight,
    };
  });
  assert.match(where.text, /hit the max tokens limit \(30 tokens\)/);
  assert.ok(where.scrollable, "the conversation is taller than the screen (else the test shows nothing)");
  assert.ok(where.bottom <= where.composerTop + 0.5 && where.top >= where.barBottom - 0.5, `the notice is on screen, between the header and the message box: ${JSON.stringify(where)}`);
  assert.ok(where.onTop, "nothing covers the notice");
  await shot(page, "ui-max-tokens-phone-long");
  assert.deepEqual(problems, []);
  await context.close();
});

test("a reply cut by the model's context window says the conversation is too long, not to raise Max tokens", async () => {
  const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`);
  const asked = await page.evaluate(() => window.tokenwireUI.config.defaults.max_tokens);
  // finish_reason "length" after 12 tokens of the `asked` allowed, length_reason "context" (SPEC §12):
  // the window, and more Max tokens would not help.
  const note = await cutReply(page, "Go on with our very long conversation", 2);
  assert.equal(fake.received.filter((f) => f.type === "chat").at(-1).params.max_tokens, asked);
  assert.equal((await lastTurn(page)).content, ENDLESS.slice(0, 12).join(""));
  const text = await note.textContent();
  assert.equal(text, `The reply was cut off after 12 tokens: the conversation is too long for the model's context window (Max tokens, ${asked}, was not reached). Start a New chat to get longer replies.`);
  assert.doesNotMatch(text, /Raise Max tokens/);
  assert.equal(await note.isVisible(), true);
  await shot(page, "ui-context-full");

  // A server before length_reason does not say: a reply shorter than the Max tokens asked reads the same.
  assert.equal(await (await cutReply(page, "Go on, older server", 4)).textContent(), text);

  // A reply that did use every token asked for keeps the advice to raise Max tokens...
  await setMaxTokens(page, 30);
  assert.equal(await (await cutReply(page, "A long answer please", 6)).textContent(), "The reply hit the max tokens limit (30 tokens) and was cut off. Raise Max tokens in Settings for longer replies.");
  assert.equal(fake.received.filter((f) => f.type === "chat").at(-1).params.max_tokens, 30);
  // ...unless the window filled at that token too: the server says context, and a new chat it is.
  assert.equal(
    await (await cutReply(page, "Fill the window to the last token", 8)).textContent(),
    "The reply was cut off after 30 tokens: the conversation is too long for the model's context window. Start a New chat to get longer replies.",
  );
  assert.deepEqual(problems, []);
  await context.close();
});

test("a reply a busy server shortened (max_tokens below the Max tokens asked) says so, not to raise Max tokens or start a new chat", async () => {
  const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`);
  const asked = await page.evaluate(() => window.tokenwireUI.config.defaults.max_tokens);
  // length_reason "max_tokens" after 12 tokens of the `asked` allowed: the server lowered max_tokens
  // under load (SPEC §4.2), so another try later may go further.
  const note = await cutReply(page, "Answer while the server is busy", 2);
  assert.equal(fake.received.filter((f) => f.type === "chat").at(-1).params.max_tokens, asked);
  const text = await note.textContent();
  assert.equal(text, `The server was busy and shortened the reply to 12 tokens (Max tokens is ${asked}). Asking again later may give a longer one.`);
  assert.doesNotMatch(text, /Raise Max tokens|New chat/);
  assert.equal(await note.isVisible(), true);
  await shot(page, "ui-server-busy");
  assert.deepEqual(problems, []);
  await context.close();
});

test("a reply cut at the server's own max_tokens cap, below the Max tokens asked, names that cap, not a busy server", async () => {
  fake.maxTokens = 20; // welcome.limits.max_tokens of the server the page talks to (not its config.json's)
  try {
    const { context, page, problems } = await openUI(`${server.origin}/?ws=${encodeURIComponent(fake.url)}`);
    await page.waitForFunction(() => window.tokenwireUI.client.welcome?.limits?.max_tokens === 20, null, { timeout: 15_000 });
    await setMaxTokens(page, 30);
    const note = await cutReply(page, "Answer up to this server's cap", 2);
    assert.equal(fake.received.filter((f) => f.type === "chat").at(-1).params.max_tokens, 30);
    const text = await note.textContent();
    assert.equal(text, "The reply hit this server's limit of 20 tokens a reply (Max tokens, 30, is above it) and was cut off.");
    assert.doesNotMatch(text, /busy|New chat|Raise Max tokens/);
    assert.deepEqual(problems, []);
    await context.close();
  } finally {
    fake.maxTokens = 8192;
  }
});

test("a question sent while the server is unreachable survives the tab being closed: reopened, it is sent and answered", async () => {
  const { context, page, problems } = await openUI(`${proxy.origin}/`);
  await setSettings(page, { temperature: 1, maxTokens: 24, seed: 3 });
  proxy.refuse(60_000);
  proxy.cut();
  await page.waitForSelector('#status[data-state="reconnecting"]', { timeout: 5000 });
  await page.fill("#prompt", "A question asked offline");
  await page.click("#send");
  const sent = await lastTurn(page);
  assert.equal(sent.status, "streaming");
  assert.equal(sent.content, "");
  await page.close(); // the tab closed before the network came back: the server never saw the chat
  proxy.refuse(0);
  const again = await context.newPage();
  again.on("pageerror", (err) => problems.push(`pageerror: ${err.message}`));
  await again.goto(`${proxy.origin}/`);
  // (tokenwireUI appears once the page's module has run: it waits for /config.json first)
  await again.waitForFunction(() => ["done", "error", "cancelled"].includes(window.tokenwireUI?.turns.at(-1)?.status), null, { timeout: 15_000 });
  const reply = await lastTurn(again);
  assert.equal(reply.id, sent.id, "the same request");
  assert.equal(reply.status, "done", reply.note);
  assert.ok(reply.content.length > 0);
  assert.equal((await serverLog(again, reply.id)).text, reply.content);
  assert.deepEqual((await again.evaluate(() => window.tokenwireUI.turns)).map((t) => t.content).slice(0, 1), ["A question asked offline"]);
  assert.deepEqual(problems, []);
  await context.close();
});

test("Stop while the server is unreachable says that it stops once the connection is back; then it ends", async () => {
  const question = "Tell me a long story about tokens";
  const { params } = await findLongReply(server.url, [{ role: "user", content: question }], { temperature: 1, max_tokens: 450, cache: false });
  const { context, page, problems } = await openUI(`${proxy.origin}/`);
  await setSettings(page, { temperature: 1, maxTokens: 450, seed: params.seed });
  const turn = await ask(page, question);
  proxy.refuse(60_000);
  proxy.cut();
  await page.waitForSelector('#status[data-state="reconnecting"]', { timeout: 5000 });
  await page.click("#stop");
  await page.waitForFunction(() => /Stopping/.test(document.querySelector(".turn.assistant:last-of-type .note").textContent), null, { timeout: 2000 });
  assert.equal(await turn.getAttribute("data-status"), "streaming", "not shown as ended before the server says so");
  proxy.refuse(0);
  await page.waitForFunction(() => window.tokenwireUI.turns.at(-1).status !== "streaming", null, { timeout: 15_000 });
  const reply = await lastTurn(page);
  // The cancel went out after the reconnect: stopped there, unless the reply had already run to its end.
  if (reply.finish === "cancelled") assert.equal(reply.note, "stopped");
  else assert.equal(reply.finish, "length");
  assert.equal(await page.isVisible("#send"), true);
  assert.equal((await serverLog(page, reply.id)).text, reply.content);
  assert.deepEqual(problems, []);
  await context.close();
});

test("two tabs of the UI share one conversation: neither loses the other's turns", async () => {
  const a = await openUI(`${server.origin}/`);
  await setSettings(a.page, { temperature: 1, maxTokens: 16, seed: 4 });
  const b = await a.context.newPage(); // same browser profile: same localStorage
  await b.goto(`${server.origin}/`);
  await b.waitForSelector('#status[data-state="open"]', { timeout: 15_000 });
  const done = (page, n) => page.waitForFunction((k) => window.tokenwireUI?.turns.length === k && window.tokenwireUI.turns.at(-1).status === "done", n, { timeout: 15_000 });
  await a.page.fill("#prompt", "Question from tab A");
  await a.page.click("#send");
  await done(a.page, 2);
  await done(b, 2); // shown in the other tab too
  await b.fill("#prompt", "Question from tab B");
  await b.click("#send");
  await done(b, 4);
  await done(a.page, 4);
  await a.page.fill("#prompt", "Another from tab A");
  await a.page.click("#send");
  await done(a.page, 6);
  await done(b, 6);
  await b.reload();
  await done(b, 6);
  const users = (await b.evaluate(() => window.tokenwireUI.turns)).filter((t) => t.role === "user").map((t) => t.content);
  assert.deepEqual(users, ["Question from tab A", "Question from tab B", "Another from tab A"]);
  assert.deepEqual(a.problems, []);
  await a.context.close();
});

test("the browser going offline mid-reply shows at once, not \"Connected\"; online reconnects at once; the reply is whole", async () => {
  const question = "Tell me a long story about tokens";
  const { params, result: expected } = await findLongReply(server.url, [{ role: "user", content: question }], { temperature: 1, max_tokens: 450, cache: false });
  const net = await new Proxy(server.port).start();
  try {
    const { context, page, problems } = await openUI(`${net.origin}/`, { init: PINNED_BACKOFF });
    await setSettings(page, { temperature: 1, maxTokens: 450, seed: params.seed });
    await recordRetries(page);
    const turn = await ask(page, question);

    // The network goes: the socket stays open but nothing comes through it, and nothing says so but the
    // browser's `offline` event (Chromium's offline mode also fails every new connection).
    net.refuse(120_000);
    net.blackhole();
    await context.setOffline(true);
    assert.equal(await turn.getAttribute("data-status"), "streaming", "the reply was still streaming");
    // At once: the heartbeat alone needs 5 s or more mid-reply (2 s of silence, then 3 s without a pong).
    await page.waitForFunction(() => document.getElementById("status").dataset.state !== "open", null, { timeout: 3000 });
    assert.equal(await page.textContent("#status-text"), "Offline");
    const banner = page.locator('#banner[data-kind="offline"]');
    await banner.waitFor({ state: "visible", timeout: 3000 });
    assert.match(await banner.textContent(), /^You're offline\. (Trying again in \d+ s, or as soon as the network is back\.|Trying again now…) Your conversation is kept/);
    assert.equal(await turn.getAttribute("data-status"), "streaming", "the reply waits for the connection; it did not end");
    await shot(page, "ui-offline");

    // Attempts fail while offline, each due twice as late: once one is due 4.8 s after its failure, the
    // network comes back, and the page must not wait for that attempt.
    await page.waitForFunction(() => window.__retries.some((r) => r.delay >= 4000), null, { timeout: 30_000 });
    const due = await page.evaluate(() => window.__retries.at(-1).at + window.__retries.at(-1).delay);
    net.cut(); // the connections the network took
    net.refuse(0);
    await context.setOffline(false);
    await page.waitForSelector('#status[data-state="open"]', { timeout: 15_000 });
    const openedAt = await page.evaluate(() => window.__opens.at(-1));
    assert.ok(openedAt < due - 1000, `reconnected on "online", ${Math.round(due - openedAt)} ms before the backoff's next attempt`);
    assert.equal(await page.isHidden("#banner"), true);

    // The reply continues where it stopped: exactly the uninterrupted text, which the server logged.
    await page.waitForFunction(() => window.tokenwireUI.turns.at(-1).status !== "streaming", null, { timeout: 30_000 });
    const reply = await lastTurn(page);
    assert.equal(reply.status, "done", reply.note);
    assert.equal(reply.content, expected.text);
    assert.equal((await serverLog(page, reply.id)).text, reply.content);
    assert.equal(await page.textContent("#status-text"), "Connected");
    assert.deepEqual(problems, []);
    await context.close();
  } finally {
    await net.close();
  }
});

test("the retry banner counts the seconds down to the next attempt, then says the attempt is under way", async () => {
  const net = await new Proxy(server.port).start();
  try {
    const { context, page, problems } = await openUI(`${net.origin}/`, { init: PINNED_BACKOFF });
    await recordRetries(page);
    net.refuse(120_000);
    net.cut();
    // Each failed attempt brings a `reconnecting` with the next delay: 0.3, 0.6, 1.2, 2.4 s... Wait until
    // the attempt due 2.4 s after its predecessor failed has been made (and failed: the next event).
    await page.waitForFunction(
      () => {
        const i = window.__retries.findIndex((r) => r.delay >= 2000);
        return i >= 0 && window.__retries.length > i + 1;
      },
      null,
      { timeout: 30_000 },
    );
    const log = await page.evaluate(() => ({ retries: window.__retries, banner: window.__banner, header: window.__header }));
    const i = log.retries.findIndex((r) => r.delay >= 2000);
    const seconds = Math.ceil(log.retries[i].delay / 1000);
    // What the banner and the header showed while that attempt was awaited (the (i+1)th event's texts).
    const during = (entries) => entries.filter((e) => e.attempt === i + 1);
    const when = during(log.banner).map((e) => e.text?.match(/Trying again (in [\d.]+ s|now…)/)?.[1] ?? e.text);
    const expectedWhen = [...Array.from({ length: seconds }, (_, k) => `in ${seconds - k} s`), "now…"];
    assert.deepEqual(when, expectedWhen, `the banner counts down (${log.retries[i].delay} ms)`);
    const header = during(log.header).map((e) => e.text);
    assert.deepEqual(header, [...Array.from({ length: seconds }, (_, k) => `Reconnecting… (${seconds - k} s)`), "Reconnecting…"]);
    // Seconds of the page's clock: from the first figure to "now" took at least the whole delay but the
    // part of a second the first figure rounded up.
    const shown = during(log.banner);
    assert.ok(shown.at(-1).at - shown[0].at >= log.retries[i].delay - 100, `counted down for ${Math.round(shown.at(-1).at - shown[0].at)} ms`);
    assert.match(shown[0].text, /^Can't reach the server at 127\.0\.0\.1:\d+\. Trying again in \d+ s\. Your conversation is kept/);

    // The server reachable again: the next attempt connects, the banner goes, and no countdown is left
    // running to bring it (or a figure in the header) back.
    net.refuse(0);
    await page.waitForSelector('#status[data-state="open"]', { timeout: 20_000 });
    assert.equal(await page.isHidden("#banner"), true);
    const settled = await page.evaluate(() => window.__banner.length);
    await page.evaluate(() => new Promise((r) => setTimeout(r, 1500))); // a stray tick would come within 1 s
    assert.equal(await page.evaluate(() => window.__banner.length), settled, "the banner stays hidden");
    assert.equal(await page.textContent("#status-text"), "Connected");
    assert.deepEqual(problems, []);
    await context.close();
  } finally {
    await net.close();
  }
});
