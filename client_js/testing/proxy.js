// A loopback TCP proxy in front of the server, to break connections the way networks do:
//   cut()        destroy every open connection (the client sees the socket die mid-stream);
//   refuse(ms)   for a while, drop new connections as soon as they arrive (server unreachable);
//   blackhole()  keep the sockets open but stop forwarding anything (a phone that switched networks:
//                nothing arrives, nothing says so) — only a heartbeat can notice.
import net from "node:net";

export class Proxy {
  constructor(targetPort, targetHost = "127.0.0.1") {
    this.targetPort = targetPort;
    this.targetHost = targetHost;
    this.pairs = new Set();
    this.refuseUntil = 0;
    this.accepted = 0;
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
    const pair = { client, upstream, blackholed: false };
    this.pairs.add(pair);
    const forward = (from, to) =>
      from.on("data", (chunk) => {
        if (!pair.blackholed && !to.destroyed) to.write(chunk);
      });
    forward(client, upstream);
    forward(upstream, client);
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
