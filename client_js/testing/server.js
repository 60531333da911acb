// Start the real `tokenwire serve` (tiny model) for the Node tests, the way tests/e2e/serve_process.py
// does: port 0 (or a given port, to restart in place), wait for the "tokenwire ready" line, stop with
// SIGTERM. A cluster's pieces too: `tokenwire gateway` and `tokenwire worker` over one store
// (startStore: $TOKENWIRE_REDIS_URL, else an embedded Valkey of the test's own). Configured by the environment that tests/e2e/test_js_client.py sets:
//   TOKENWIRE_PYTHON       the Python with tokenwire installed (default: <repo>/.venv/bin/python)
//   TOKENWIRE_MODEL_DIR    a model folder (default: the tiny test model, built once into a temp folder)
//   TOKENWIRE_REDIS_URL    an external Redis/Valkey (default: each server's embedded Valkey)
//   TOKENWIRE_KEY_PREFIX   prefix of the keys these tests create (a random suffix is added per server)
//   TOKENWIRE_ARTIFACTS    where screenshots go (default: <repo>/test-artifacts)
import { spawn, execFileSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { createWriteStream, existsSync, mkdirSync, mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

export const CLIENT_JS = join(dirname(fileURLToPath(import.meta.url)), "..");
export const REPO = join(CLIENT_JS, "..");
export const PYTHON = process.env.TOKENWIRE_PYTHON || join(REPO, ".venv", "bin", "python");
export const ARTIFACTS = process.env.TOKENWIRE_ARTIFACTS || join(REPO, "test-artifacts");

const live = new Set();
process.on("exit", () => {
  for (const p of live) p.kill("SIGKILL");
});

/** The model folder: $TOKENWIRE_MODEL_DIR, else the tiny random Llama of server/bench/tiny_model.py. */
export function modelDir() {
  if (process.env.TOKENWIRE_MODEL_DIR) return process.env.TOKENWIRE_MODEL_DIR;
  const dir = join(tmpdir(), "tokenwire-js-tiny-model");
  if (!existsSync(join(dir, "config.json"))) {
    execFileSync(PYTHON, ["-c", `from pathlib import Path\nfrom server.bench.tiny_model import build_tiny_model\nbuild_tiny_model(Path(${JSON.stringify(dir)}))`], {
      cwd: REPO,
      stdio: ["ignore", "ignore", "inherit"],
      timeout: 120_000,
    });
  }
  return dir;
}

/** A fresh key prefix (and data folder) for one logical server, shared by its restarts. */
export function newStoreScope() {
  const base = process.env.TOKENWIRE_KEY_PREFIX || "twjs:";
  return {
    prefix: `${base}${randomBytes(5).toString("hex")}:`,
    dataDir: mkdtempSync(join(tmpdir(), "tokenwire-js-data-")),
  };
}

/**
 * Start `tokenwire serve`; resolves with {url, port, origin, proc, stop(), kill()} once it is ready.
 * `scope` (from newStoreScope) is reused to restart a server on the same store.
 */
export async function startServer({ port = 0, scope = newStoreScope(), timeoutMs = 90_000, extraArgs = [] } = {}) {
  const args = ["serve", "--port", String(port), "--model", modelDir(), "--data-dir", scope.dataDir, "--key-prefix", scope.prefix, ...extraArgs];
  if (process.env.TOKENWIRE_REDIS_URL) args.push("--redis-url", process.env.TOKENWIRE_REDIS_URL);
  return launch(args, { scope, timeoutMs, readyLine: "tokenwire ready" });
}

/** The store a cluster's gateways and workers share: {url, stop()}. $TOKENWIRE_REDIS_URL when set (the
 * test keeps to its own key prefix), else an embedded Valkey (no persistence) that stop() ends. */
export async function startStore() {
  if (process.env.TOKENWIRE_REDIS_URL) return { url: process.env.TOKENWIRE_REDIS_URL, stop: async () => {} };
  const dir = mkdtempSync(join(tmpdir(), "tokenwire-js-store-"));
  const code = ["import sys", "from pathlib import Path", "from server.store.embedded import EmbeddedValkey", `v = EmbeddedValkey(Path(${JSON.stringify(dir)}), persist=False)`, "print('valkey at', v.start(), flush=True)", "sys.stdin.read()", "v.stop()"].join("\n");
  const proc = spawn(PYTHON, ["-c", code], { cwd: REPO, stdio: ["pipe", "pipe", "inherit"] });
  live.add(proc);
  const exited = new Promise((resolve) => proc.on("exit", resolve));
  exited.then(() => live.delete(proc));
  const url = await new Promise((resolve, reject) => {
    let buf = "";
    proc.stdout.on("data", (chunk) => {
      buf += chunk.toString("utf8");
      const m = /^valkey at (\S+)$/m.exec(buf);
      if (m) resolve(m[1]);
    });
    exited.then((code) => reject(new Error(`the embedded Valkey did not start (exit ${code})`)));
  });
  return {
    url,
    async stop() {
      proc.stdin.end(); // the helper stops its Valkey and exits
      await exited;
    },
  };
}

/** `tokenwire gateway` on `store` (no model; ready once listening): the server object of startServer. */
export function startGateway({ store, port = 0, scope, timeoutMs = 60_000, extraArgs = [] }) {
  const args = ["gateway", "--port", String(port), "--redis-url", store.url, "--key-prefix", scope.prefix, ...extraArgs];
  return launch(args, { scope, timeoutMs, readyLine: "tokenwire listening" });
}

/** `tokenwire worker` with the tiny model on `store`, ready once its model is loaded (no url). */
export function startWorker({ store, scope, timeoutMs = 90_000, extraArgs = [] }) {
  const args = ["worker", "--model", modelDir(), "--redis-url", store.url, "--key-prefix", scope.prefix, ...extraArgs];
  return launch(args, { scope, timeoutMs, readyLine: "tokenwire ready" });
}

/** Run `python -m server.cli ARGS` until it prints a line starting with `readyLine`. */
async function launch(cliArgs, { scope, timeoutMs, readyLine }) {
  const args = ["-m", "server.cli", ...cliArgs];
  const what = `tokenwire ${cliArgs[0]}`;
  mkdirSync(scope.dataDir, { recursive: true });
  const stderrPath = join(scope.dataDir, `${cliArgs[0]}-${Date.now()}.stderr`);
  const stderr = createWriteStream(stderrPath);
  const proc = spawn(PYTHON, args, { cwd: REPO, env: { ...process.env, PYTHONUNBUFFERED: "1" }, stdio: ["ignore", "pipe", "pipe"] });
  live.add(proc);
  proc.stderr.pipe(stderr);
  const exited = new Promise((resolve) => proc.on("exit", (code, signal) => resolve({ code, signal })));
  exited.then(() => live.delete(proc));
  const tail = () => {
    try {
      return readFileSync(stderrPath, "utf8").slice(-3000);
    } catch {
      return "";
    }
  };
  const url = await new Promise((resolve, reject) => {
    let buf = "";
    let listening = null;
    const timer = setTimeout(() => {
      proc.kill("SIGKILL");
      reject(new Error(`${what} not ready in ${timeoutMs} ms:\n${tail()}`));
    }, timeoutMs);
    proc.stdout.on("data", (chunk) => {
      buf += chunk.toString("utf8");
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        const m = /tokenwire listening on (ws:\/\/\S+)/.exec(line);
        if (m) listening = m[1];
        if (line.startsWith(readyLine)) {
          clearTimeout(timer);
          resolve(listening);
        }
      }
    });
    exited.then(({ code, signal }) => {
      clearTimeout(timer);
      reject(new Error(`${what} exited (${code ?? signal}) before it was ready:\n${tail()}`));
    });
  });
  const u = url ? new URL(url) : null;
  return {
    url,
    port: u ? Number(u.port) : null,
    origin: u ? `http://${u.host}` : null,
    proc,
    scope,
    stderrPath,
    exited,
    /** SIGTERM (graceful: connections closed with 1012), then SIGKILL after a grace period. */
    async stop(graceMs = 30_000) {
      if (proc.exitCode !== null || proc.signalCode !== null) return exited;
      proc.kill("SIGTERM");
      const t = setTimeout(() => proc.kill("SIGKILL"), graceMs);
      const r = await exited;
      clearTimeout(t);
      return r;
    },
    async kill() {
      proc.kill("SIGKILL");
      return exited;
    },
  };
}
