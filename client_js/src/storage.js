// Where the client keeps its session token between connections and page loads: any object with
// getItem/setItem/removeItem (Web Storage style, sync or returning promises). Browsers get localStorage.

/** An in-memory store with the Web Storage methods (the default outside browsers). */
export class MemoryStorage {
  #items = new Map();

  getItem(key) {
    return this.#items.has(key) ? this.#items.get(key) : null;
  }

  setItem(key, value) {
    this.#items.set(key, String(value));
  }

  removeItem(key) {
    this.#items.delete(key);
  }
}

/** localStorage when there is a usable one (not in private modes that throw), else a MemoryStorage. */
export function defaultStorage() {
  try {
    const ls = globalThis.localStorage;
    if (ls) {
      const probe = "tokenwire:probe";
      ls.setItem(probe, "1");
      ls.removeItem(probe);
      return ls;
    }
  } catch {
    // Access denied (sandboxed iframe, storage disabled): fall through.
  }
  return new MemoryStorage();
}

/**
 * react-native-mmkv's instance (getString/set/delete, synchronous) as the Web Storage shape the client's
 * `storage` and `persist` options take. AsyncStorage already has that shape: pass it as is.
 */
export function mmkvStorage(mmkv) {
  return {
    getItem: (key) => mmkv.getString(key) ?? null,
    setItem: (key, value) => mmkv.set(key, String(value)),
    removeItem: (key) => mmkv.delete(key),
  };
}
