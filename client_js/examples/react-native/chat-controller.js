// The chat screen's logic, free of React so that it runs under Node's test runner with React Native's
// modules replaced by fakes (client_js/test/react-native-example.test.js). It owns one TokenwireClient:
//   * AppState: background → pause() (the socket closes cleanly after a grace; the reply runs on at the
//     server), active → resume() (reconnect at once, the reply continues from its offset);
//   * NetInfo: no network → the client waits instead of spinning its backoff;
//   * AsyncStorage: the session token and every reply in flight, so that a reply survives the app being
//     killed: the next launch restores it, with nothing repeated or missing.
// `onChange(view)` gets {state, messages, streaming} after every change; render from it. `tokenwire` is
// the client package's module (import * as tokenwire from "@tokenwire/client").

export function createChatController({ tokenwire, url, AppState, NetInfo, AsyncStorage, WebSocket, graceMs, onChange = () => {} }) {
  const client = new tokenwire.TokenwireClient(url, {
    storage: AsyncStorage,
    persist: AsyncStorage,
    coalesceMs: 100, // fewer frames for the radio; offsets and text are unchanged
    // A phone is often away for minutes: ask the server to keep a reply running that long with nobody
    // attached (it caps this at welcome.limits.max_detach_timeout_ms; its default is 30 s).
    detachTimeoutMs: 10 * 60 * 1000,
    ...(WebSocket ? { WebSocket } : {}),
  });
  const messages = []; // {role, text, id?, finish?, cancelReason?, error?}
  let streaming = null; // the id of the reply streaming now
  const render = () => onChange({ state: client.state, messages: messages.map((m) => ({ ...m })), streaming });
  const offState = client.on("state", render);
  const offApp = tokenwire.withAppState(client, AppState, { graceMs }); // graceMs: default 5000
  const offNet = tokenwire.withNetInfo(client, NetInfo);

  async function follow(id, stream, bubble) {
    streaming = id;
    render();
    try {
      for await (const _item of stream) {
        bubble.text = stream.text; // deltas, or a reset (the log restarted: the text starts over)
        render();
      }
      bubble.text = stream.text;
      bubble.finish = stream.finishReason; // stop, length, cancelled
      // "detach_timeout": the server gave up while the app was away, not the user's Stop.
      bubble.cancelReason = stream.cancelReason;
    } catch (err) {
      bubble.finish = "error";
      bubble.error = String(err?.message ?? err);
    } finally {
      if (streaming === id) streaming = null;
      render();
    }
  }

  return {
    client,
    /** At launch: the replies a killed app left unfinished, shown at once and continued. */
    async start() {
      for (const { id, stream } of await client.restore()) {
        const bubble = { role: "assistant", id, text: stream.text };
        messages.push(bubble);
        follow(id, stream, bubble);
      }
      render();
    },
    /** Send one user turn (content mode: the server keeps the conversation). */
    send(text) {
      messages.push({ role: "user", text });
      const stream = client.chat(text);
      const bubble = { role: "assistant", id: stream.id, text: "" };
      messages.push(bubble);
      return follow(stream.id, stream, bubble);
    },
    /** Stop the reply streaming now; works after any number of reconnects. */
    stop() {
      if (streaming) client.cancel(streaming);
    },
    dispose() {
      offApp();
      offNet();
      offState();
      client.close();
    },
  };
}
