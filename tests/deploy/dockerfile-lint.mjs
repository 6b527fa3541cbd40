// Lints the repository's Dockerfiles (docker/*Dockerfile): dockerfile-utils'
// validator (the Dockerfile language server's: syntax, instruction and flag
// errors) with every check raised to an error, plus the rules our images
// promise (docs/deploy.md), which a generic linter does not know:
//   - the final stage runs as a non-root USER;
//   - every `apt-get install` has --no-install-recommends and the same RUN
//     removes /var/lib/apt/lists;
//   - every COPY from the build context names a path .dockerignore lets in;
//   - nothing is fetched with ADD or curl/wget (no network beyond Debian's);
//   - the Pipemare image has a HEALTHCHECK.
//   node tests/deploy/dockerfile-lint.mjs --repo DIR [--self-test]
// --self-test breaks each rule in a copy of the text and fails unless the
// lint then fails naming that rule.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const utils = require("dockerfile-utils");

const args = process.argv.slice(2);
const repo = args[args.indexOf("--repo") + 1];
if (!repo || args.indexOf("--repo") < 0) {
  console.error("usage: dockerfile-lint.mjs --repo DIR [--self-test]");
  process.exit(2);
}

// Every ValidatorSettings key at ERROR (2).
const settings = new Proxy({}, { get: () => 2 });

// .dockerignore as an allow-list: "*" then "!path" lines (what ours is).
function dockerignoreAllows(ignore, source) {
  let allowed = true;
  for (const raw of ignore.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    const negate = line.startsWith("!");
    const pattern = (negate ? line.slice(1) : line).replace(/\/$/, "");
    const re = new RegExp(
      "^" + pattern.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*\*\//g, "(.*/)?")
        .replace(/\*/g, "[^/]*") + "(/.*)?$");
    if (re.test(source.replace(/\/$/, "").replace(/^\.\//, ""))) allowed = negate;
  }
  return allowed;
}

// Joins continuation lines; returns [{instruction, text, line}].
function instructions(text) {
  const out = [];
  let current = null;
  text.split("\n").forEach((raw, i) => {
    const line = raw.replace(/\s+$/, "");
    if (!current) {
      if (!line.trim() || line.trim().startsWith("#")) return;
      const m = line.trim().match(/^(\w+)\s*(.*)$/);
      current = { instruction: m[1].toUpperCase(), text: m[2], line: i + 1 };
    } else if (!line.trim().startsWith("#")) {
      current.text += " " + line.trim();
    }
    if (current.text.endsWith("\\")) {
      current.text = current.text.slice(0, -1);
    } else {
      out.push(current);
      current = null;
    }
  });
  return out;
}

function lint(name, text, ignore) {
  const problems = [];
  for (const d of utils.validate(text, settings)) {
    problems.push(`${name}:${d.range.start.line + 1}: [dockerfile-utils] ${d.message}`);
  }
  const all = instructions(text);
  const lastFrom = all.map((x) => x.instruction).lastIndexOf("FROM");
  const final = all.slice(lastFrom);
  const user = final.filter((x) => x.instruction === "USER").pop();
  if (!user || /^(root|0)(:|$)/.test(user.text.trim())) {
    problems.push(`${name}: [non-root] the final stage must end with a USER other than root`);
  }
  for (const x of all) {
    if (x.instruction === "RUN" && /apt-get\s+(-\S+\s+)*install/.test(x.text)) {
      if (!x.text.includes("--no-install-recommends")) {
        problems.push(`${name}:${x.line}: [apt] apt-get install without --no-install-recommends`);
      }
      if (!/rm -rf [^&]*\/var\/lib\/apt\/lists/.test(x.text)) {
        problems.push(`${name}:${x.line}: [apt] the RUN that installs must remove /var/lib/apt/lists`);
      }
    }
    if (x.instruction === "ADD" && /https?:\/\//.test(x.text)) {
      problems.push(`${name}:${x.line}: [network] ADD of a URL: only Debian's packages are fetched`);
    }
    if (x.instruction === "RUN" && /\b(curl|wget)\b/.test(x.text)) {
      problems.push(`${name}:${x.line}: [network] curl/wget in a RUN: only Debian's packages are fetched`);
    }
    if (x.instruction === "COPY" && !/--from=/.test(x.text)) {
      const parts = x.text.split(/\s+/).filter((p) => !p.startsWith("--"));
      for (const source of parts.slice(0, -1)) {
        if (!fs.existsSync(path.join(repo, source))) {
          problems.push(`${name}:${x.line}: [copy] ${source} does not exist in the repository`);
        } else if (!dockerignoreAllows(ignore, source)) {
          problems.push(`${name}:${x.line}: [copy] ${source} is excluded by .dockerignore`);
        }
      }
    }
  }
  if (name === "Dockerfile" && !all.some((x) => x.instruction === "HEALTHCHECK")) {
    problems.push(`${name}: [healthcheck] the Pipemare image must declare a HEALTHCHECK`);
  }
  return problems;
}

const dockerDir = path.join(repo, "docker");
const files = fs.readdirSync(dockerDir).filter((f) => /Dockerfile$/.test(f)).sort();
const ignore = fs.readFileSync(path.join(repo, ".dockerignore"), "utf8");
if (files.length === 0) {
  console.error("no Dockerfile in docker/");
  process.exit(1);
}

if (!args.includes("--self-test")) {
  const problems = files.flatMap((f) => lint(f, fs.readFileSync(path.join(dockerDir, f), "utf8"), ignore));
  for (const p of problems) console.error(p);
  console.log(`${files.join(", ")}: ${problems.length} problem(s)`);
  process.exit(problems.length ? 1 : 0);
}

// Self-test: each break must make the lint fail naming its rule.
const text = fs.readFileSync(path.join(dockerDir, "Dockerfile"), "utf8");
const breaks = [
  ["dockerfile-utils", (t) => t.replace(/^CMD \[.*\]$/m, (m) => m + "\nCMD [\"second\"]")],
  ["dockerfile-utils", (t) => t.replace("WORKDIR /src", "WORKDIR src")],
  ["non-root", (t) => t.replace("USER 10001:10001", "USER root")],
  ["non-root", (t) => t.replace(/^USER .*$/m, "")],
  ["apt", (t) => t.replace(/--no-install-recommends/g, "")],
  ["apt", (t) => t.replace(/rm -rf \/var\/lib\/apt\/lists\/\*/g, "true")],
  ["network", (t) => t.replace("WORKDIR /src", "WORKDIR /src\nADD https://example.com/x.tgz /x.tgz")],
  ["copy", (t) => t.replace("COPY client client", "COPY tests tests")],
  ["copy", (t) => t.replace("COPY client client", "COPY no-such-dir client")],
  ["healthcheck", (t) => t.replace(/^HEALTHCHECK[\s\S]*?\n(?=CMD)/m, "")],
];
let failed = 0;
if (lint("Dockerfile", text, ignore).length) {
  console.error("self-test: the unbroken Dockerfile must pass");
  failed++;
}
for (const [rule, mutate] of breaks) {
  const broken = mutate(text);
  if (broken === text) {
    console.error(`self-test: a break for [${rule}] did not change the text (stale pattern)`);
    failed++;
    continue;
  }
  const problems = lint("Dockerfile", broken, ignore);
  if (!problems.some((p) => p.includes(`[${rule}]`))) {
    console.error(`self-test: breaking [${rule}] went unnoticed: ${problems.join("; ") || "no problems"}`);
    failed++;
  }
}
console.log(`self-test: ${breaks.length - failed} of ${breaks.length} breaks caught`);
process.exit(failed ? 1 : 0);
