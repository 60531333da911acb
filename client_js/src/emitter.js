// A minimal event emitter that behaves the same in browsers and Node (listeners never break the client:
// an exception in one is reported asynchronously, like an uncaught error in an event handler).

export class Emitter {
  #listeners = new Map();

  /** Add a listener; returns a function that removes it. */
  on(type, fn) {
    if (typeof fn !== "function") throw new TypeError("listener must be a function");
    let set = this.#listeners.get(type);
    if (!set) this.#listeners.set(type, (set = new Set()));
    set.add(fn);
    return () => this.off(type, fn);
  }

  off(type, fn) {
    this.#listeners.get(type)?.delete(fn);
  }

  /** Resolve with the next event of this type (and remove the listener). */
  once(type) {
    return new Promise((resolve) => {
      const off = this.on(type, (ev) => {
        off();
        resolve(ev);
      });
    });
  }

  emit(type, event) {
    const set = this.#listeners.get(type);
    if (!set) return;
    for (const fn of [...set]) {
      try {
        fn(event);
      } catch (err) {
        setTimeout(() => {
          throw err;
        });
      }
    }
  }
}
