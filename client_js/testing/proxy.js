// A loopback TCP proxy in front of the server, to break connections the way networks do:
//   cut()        destroy every open connection (the client sees the socket die mid-stream);
//   refuse(ms)   for a while, drop new connections as soon as they arrive (server unreachable);
//   blackhole()  keep the sockets open but stop forwarding anything (a phone that switched networks:
//                nothing arrives, nothing says so) — only a heartbeat can notice;
//   latency(ms, jitterMs, random)  delay every chunk by ms plus up to jitterMs (order kept per direction);
//   dropHandshakes(n)  the next n connections die after the client's upgrade request reached the server,
//                before its answer comes back (the radio lost mid-handshake).
import net from "node:net";

export class Proxy {
  constructor(targetPort, targetHost = "127.0.0.1") {
    this.targetPort = targetPort;
    this.targetHost = targetHost;
    this.pairs = new Set();
    this.refuseUntil = 0;
    this.accepted = 0;
    this.delayMs = 0;
    this.jitterMs = 0;
    this.random = Math.random;
    this.handshakesToDrop = 0;
    this.handshakesDropped = 0;
    this.server = net.createServer((client) => this.#handle(client));
  }

  async start() {
    await new Promise((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    this.port = this.server.address().port;
    return this;
  }

  get origin() {
    return `http://127.0.0.1:${this.port}`;
  }

  get wsUrl() {
    return `ws://127.0.0.1:${this.port}/v1/ws`;
  }

  #handle(client) {
    if (Date.now() < this.refuseUntil) {
      client.destroy();
      return;
    }
    this.accepted += 1;
    const upstream = net.connect(this.targetPort, this.targetHost);
    const pair = { client, upstream, blackholed: false, dropHandshake: false };
    if (this.handshakesToDrop > 0) {
      this.handshakesToDrop -= 1;
      pair.dropHandshake = true;
    }
    this.pairs.add(pair);
    const forward = (from, to, isAnswer) => {
      let last = 0; // with latency, chunks still leave in order: never before the previous one
      from.on("data", (chunk) => {
        if (isAnswer && pair.dropHandshake) {
          // The server answered the upgrade; the client never hears it.
          this.handshakesDropped += 1;
          client.destroy();
          upstream.destroy();
          return;
        }
        const send = () => {
          if (!pair.blackholed && !to.destroyed) to.write(chunk);
        };
        const wait = this.delayMs + this.jitterMs * this.random();
        if (wait <= 0 && last <= Date.now()) return send();
        const at = Math.max(Date.now() + wait, last);
        last = at;
        setTimeout(send, at - Date.now());
      });
    };
    forward(client, upstream, false);
    forward(upstream, client, true);
    const close = () => {
      this.pairs.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    for (const s of [client, upstream]) {
      s.on("error", close);
      s.on("close", close);
    }
  }

  /** Destroy every open connection; returns how many there were. */
  cut() {
    const n = this.pairs.size;
    for (const { client, upstream } of [...this.pairs]) {
      client.resetAndDestroy?.() ?? client.destroy();
      upstream.destroy();
    }
    this.pairs.clear();
    return n;
  }

  /** Refuse new connections for `ms` milliseconds. */
  refuse(ms) {
    this.refuseUntil = Date.now() + ms;
  }

  /** Delay every forwarded chunk by `ms` plus a uniform share of `jitterMs` (0, 0: none). */
  latency(ms, jitterMs = 0, random = Math.random) {
    this.delayMs = ms;
    this.jitterMs = jitterMs;
    this.random = random;
  }

  /** The next `n` connections are cut once the server has answered their upgrade, before the client sees it. */
  dropHandshakes(n = 1) {
    this.handshakesToDrop += n;
  }

  /** Silently stop forwarding on every open connection (they stay open). */
  blackhole() {
    for (const p of this.pairs) p.blackholed = true;
    return this.pairs.size;
  }

  async close() {
    this.cut();
    await new Promise((resolve) => this.server.close(resolve));
  }
}
