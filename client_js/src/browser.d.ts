// The browser entry (src/browser.js) has the same API as the package's main entry.
export * from "./index.js";
