// Builds the bundles into dist/ (and, with --tests, the unit tests into dist-test/) with esbuild.
import { build } from "esbuild";
import { copyFileSync, readdirSync } from "node:fs";

const common = { bundle: true, target: "es2022", logLevel: "warning", legalComments: "none" };

if (process.argv.includes("--tests")) {
  const tests = readdirSync("test").filter((f) => f.endsWith(".test.ts"));
  await build({
    ...common,
    entryPoints: tests.map((f) => `test/${f}`),
    outdir: "dist-test",
    platform: "node",
    format: "esm",
    outExtension: { ".js": ".mjs" },
  });
} else {
  for (const [entry, out] of [
    ["src/index.ts", "dist/knownstate-client.js"],
    ["src/mutants-entry.ts", "dist/knownstate-client-mutants.js"],
    ["src/page.ts", "dist/knownstate-page.js"],
  ]) {
    await build({ ...common, entryPoints: [entry], outfile: out, format: "iife", platform: "browser" });
  }
  copyFileSync("index.html", "dist/index.html"); // the page, beside its script
}
