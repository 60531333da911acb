// Copy the ESM build of @msgpack/msgpack (from node_modules, the version package-lock.json pins) into
// vendor/msgpack/, with its license. The gateway serves vendor/ to browsers, so `make run` works on a
// machine without Node; test/vendor.test.js fails when the copy and the locked version differ.
//
//   node scripts/vendor-msgpack.mjs
import { copyFileSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const pkg = join(root, "node_modules", "@msgpack", "msgpack");
const src = join(pkg, "dist.esm");
const dest = join(root, "vendor", "msgpack");

export function vendoredFiles(dir = src) {
  const out = [];
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, entry.name);
    if (entry.isDirectory()) out.push(...vendoredFiles(p));
    else if (entry.name.endsWith(".mjs")) out.push(relative(src, p));
  }
  return out.sort();
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const version = JSON.parse(readFileSync(join(pkg, "package.json"), "utf8")).version;
  rmSync(dest, { recursive: true, force: true });
  for (const f of vendoredFiles()) {
    mkdirSync(dirname(join(dest, f)), { recursive: true });
    copyFileSync(join(src, f), join(dest, f));
  }
  copyFileSync(join(pkg, "LICENSE"), join(dest, "LICENSE"));
  writeFileSync(
    join(dest, "VERSION"),
    `@msgpack/msgpack ${version} (dist.esm, unmodified; ISC license in LICENSE)\n`,
  );
  console.log(`vendored @msgpack/msgpack ${version} into ${relative(root, dest)}`);
}
