// App lifecycle adapters: each wires a platform's events to client.pause(), client.resume() and
// client.setOnline(), takes the platform's module as an argument (nothing here imports a package an app
// may not have), and returns a function that unsubscribes. A mobile OS suspends a backgrounded app after
// seconds and its socket dies silently; these let the client close cleanly first and resume at once.

/**
 * React Native's AppState: "active" resumes, "background" pauses (closing the socket after graceMs).
 * "inactive" (iOS: a call, the app switcher) changes nothing.
 */
export function withAppState(client, AppState, { graceMs } = {}) {
  const sub = AppState.addEventListener("change", (state) => {
    if (state === "active") client.resume();
    else if (state === "background") client.pause({ graceMs });
  });
  return () => sub?.remove?.();
}

/**
 * @react-native-community/netinfo: no connection, or one known to have no internet, means offline (the
 * client waits instead of spinning its backoff); connected again, it reconnects at once. An unknown
 * reachability (null) counts as online.
 */
export function withNetInfo(client, NetInfo) {
  const off = NetInfo.addEventListener((state) => {
    client.setOnline(state?.isConnected !== false && state?.isInternetReachable !== false);
  });
  return typeof off === "function" ? off : () => off?.remove?.();
}

/** The browser: a hidden page pauses and a visible one resumes; offline and online as above. */
export function withBrowserLifecycle(client, { window: w = globalThis.window, document: d = globalThis.document, graceMs } = {}) {
  const onVisibility = () => (d.visibilityState === "hidden" ? client.pause({ graceMs }) : client.resume());
  const onOnline = () => client.setOnline(true);
  const onOffline = () => client.setOnline(false);
  d.addEventListener("visibilitychange", onVisibility);
  w.addEventListener("online", onOnline);
  w.addEventListener("offline", onOffline);
  return () => {
    d.removeEventListener("visibilitychange", onVisibility);
    w.removeEventListener("online", onOnline);
    w.removeEventListener("offline", onOffline);
  };
}
