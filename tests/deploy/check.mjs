#!/usr/bin/env node
// Checks of the Kubernetes manifests (deploy/k8s), run by ctest
// (tests/deploy/CMakeLists.txt, label config):
//   node tests/deploy/check.mjs schema      every object of every rendered
//                                        kustomization validates against its
//                                        schema; unknown fields are refused
//   node tests/deploy/check.mjs crossref    lib/crossref.mjs's rules on every render
//   node tests/deploy/check.mjs self-test   breaks the manifests, rendered and as
//                                        files in a temporary copy, and expects
//                                        each check above (and kustomize and
//                                        yamllint) to fail as it should
// Options: --repo DIR (default: this file's ../..), --kubectl PATH,
// --yamllint PATH (self-test). Needs tests/deploy/node_modules (npm-ci.sh).
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import yaml from "js-yaml";
import { kustomizations, render } from "./lib/render.mjs";
import { validateAll } from "./lib/schema.mjs";
import { checkObjects, flagsOf } from "./lib/crossref.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const options = { repo: path.resolve(here, "../.."), kubectl: "kubectl", yamllint: "yamllint" };
const modes = [];
for (let i = 2; i < process.argv.length; ++i) {
  const arg = process.argv[i];
  const m = /^--(repo|kubectl|yamllint)(?:=(.*))?$/.exec(arg);
  if (m) options[m[1]] = m[2] ?? process.argv[++i];
  else modes.push(arg);
}
if (modes.length !== 1 || !["schema", "crossref", "self-test"].includes(modes[0])) {
  console.error("usage: check.mjs [--repo DIR] [--kubectl PATH] [--yamllint PATH] schema|crossref|self-test");
  process.exit(2);
}

function crossrefContext(repo) {
  return {
    exampleSpec: yaml.load(fs.readFileSync(path.join(repo, "examples/mnist_pipemare.yaml"), "utf8")),
    parseYaml: (text) => yaml.load(text),
    expectExample: true,
  };
}

// Renders every kustomization under REPO/deploy/k8s: [[dir, objects]].
function renderAll(repo) {
  const k8s = path.join(repo, "deploy/k8s");
  return kustomizations(k8s).map((dir) => [dir, render(options.kubectl, path.join(k8s, dir))]);
}

async function schemaProblems(renders) {
  const problems = [];
  for (const [dir, objects] of renders) {
    for (const p of await validateAll(objects)) problems.push(`${dir}: ${p}`);
  }
  return problems;
}

function crossrefProblems(renders, repo) {
  const problems = [];
  for (const [dir, objects] of renders) {
    for (const p of checkObjects(objects, crossrefContext(repo))) problems.push(`${dir}: ${p}`);
  }
  return problems;
}

function report(what, renders, problems) {
  for (const p of problems) console.log(`FAIL ${p}`);
  const counts = renders.map(([dir, objects]) => `${dir} (${objects.length} objects)`).join(", ");
  console.log(`${what}: ${problems.length ? `${problems.length} problem(s)` : "ok"}: ${counts}`);
  return problems.length ? 1 : 0;
}

// --- self-test ---------------------------------------------------------------

const clone = (x) => JSON.parse(JSON.stringify(x));
const find = (objects, kind, name) => {
  const obj = objects.find((o) => o.kind === kind && o.metadata?.name === name);
  if (!obj) throw new Error(`self-test: no ${kind} ${name} in the render`);
  return obj;
};
const podSpec = (objects, name) => find(objects, "StatefulSet", name).spec.template.spec;
const container = (objects, name) => podSpec(objects, name).containers[0];
const coordinator = (objects) => container(objects, "pipemare-coordinator");
const worker = (objects) => container(objects, "pipemare-worker");
// Replaces the flag --name's value in the container's args (or drops it).
const setFlag = (c, name, value) => {
  const at = c.args.findIndex((a) => a === `--${name}` || a.startsWith(`--${name}=`));
  if (at < 0) throw new Error(`self-test: no --${name} in ${c.name}'s args`);
  if (value === null) c.args.splice(at, 1);
  else c.args[at] = `--${name}=${value}`;
};
const volume = (spec, name) => spec.volumes.find((v) => v.name === name);
const mount = (c, name) => c.volumeMounts.find((m) => m.name === name);

// Each mutation breaks a render one way and names the check that must say so:
// "schema" or a crossref rule id.
const MUTATIONS = [
  // Schema: unknown fields at several depths, wrong types, missing fields.
  ["overlays/cpu", "schema", "an unknown field in a StatefulSet's spec (replica)", (o) => { find(o, "StatefulSet", "pipemare-worker").spec.replica = 4; }],
  ["overlays/cpu", "schema", "a misspelt probe (readinesProbe)", (o) => { const c = worker(o); c.readinesProbe = c.readinessProbe; delete c.readinessProbe; }],
  ["overlays/cpu", "schema", "an unknown field in a grpc probe (serivce)", (o) => { coordinator(o).readinessProbe.grpc.serivce = "x"; }],
  ["overlays/cpu", "schema", "resources one level too deep (resources.resources)", (o) => { const c = worker(o); c.resources = { resources: c.resources }; }],
  ["overlays/cpu", "schema", "an unknown field in metadata (label)", (o) => { find(o, "Service", "pipemare-worker").metadata.label = { a: "b" }; }],
  ["overlays/cpu", "schema", "replicas as a string", (o) => { find(o, "StatefulSet", "pipemare-worker").spec.replicas = "4"; }],
  ["overlays/cpu", "schema", "a container without a name", (o) => { delete worker(o).name; }],
  ["overlays/cpu", "schema", "a probe port as a name in a grpc probe (an integer field)", (o) => { worker(o).livenessProbe.grpc.port = "health"; }],
  ["overlays/cpu", "schema", "a kind no schema knows (Servce)", (o) => { find(o, "Service", "pipemare-worker").kind = "Servce"; }],
  ["overlays/monitoring", "schema", "an unknown field in a ServiceMonitor endpoint (prot)", (o) => { const e = find(o, "ServiceMonitor", "pipemare-coordinator").spec.endpoints[0]; e.prot = e.port; delete e.port; }],
  ["overlays/monitoring", "schema", "a PodMonitor without its selector", (o) => { delete find(o, "PodMonitor", "pipemare-worker").spec.selector; }],
  // Services and their pods.
  ["overlays/cpu", "service-selector", "the coordinator Service selects no pods", (o) => { find(o, "Service", "pipemare-coordinator").spec.selector["app.kubernetes.io/component"] = "coordinater"; }],
  ["overlays/cpu", "service-selector", "a Service targetPort the pods lack", (o) => { find(o, "Service", "pipemare-worker").spec.ports[1].targetPort = "metric"; }],
  ["overlays/cpu", "statefulset-service", "serviceName names no Service", (o) => { find(o, "StatefulSet", "pipemare-worker").spec.serviceName = "pipemare-workers"; }],
  ["overlays/cpu", "statefulset-service", "the governing Service is not headless", (o) => { delete find(o, "Service", "pipemare-worker").spec.clusterIP; }],
  ["overlays/cpu", "statefulset-service", "the coordinator's governing Service is not headless", (o) => { delete find(o, "Service", "pipemare-coordinator-headless").spec.clusterIP; }],
  // Probes and ports.
  ["overlays/cpu", "probes", "a probe port that is no container port", (o) => { worker(o).readinessProbe.grpc.port = 7074; }],
  ["overlays/cpu", "probes", "a probe on the metrics port, not the health port", (o) => { coordinator(o).livenessProbe.grpc.port = 9460; }],
  ["overlays/cpu", "probes", "readiness asks the coordinator's service of a worker", (o) => { worker(o).readinessProbe.grpc.service = "pipemare.v1.Coordinator"; }],
  ["overlays/cpu", "probes", "liveness asks for readiness", (o) => { coordinator(o).livenessProbe.grpc.service = "pipemare.v1.Coordinator"; }],
  ["overlays/cpu", "probes", "no startup probe", (o) => { delete worker(o).startupProbe; }],
  ["overlays/cpu", "ports", "--metrics-listen on a port that is no container port", (o) => { setFlag(worker(o), "metrics-listen", "0.0.0.0:9462"); }],
  ["overlays/cpu", "ports", "--health-listen moved (probes and container port left behind)", (o) => { setFlag(coordinator(o), "health-listen", "0.0.0.0:7074"); }],
  // Monitoring.
  ["overlays/monitoring", "monitor", "a ServiceMonitor port no Service has", (o) => { find(o, "ServiceMonitor", "pipemare-coordinator").spec.endpoints[0].port = "metric"; }],
  ["overlays/monitoring", "monitor", "a ServiceMonitor selecting nothing", (o) => { find(o, "ServiceMonitor", "pipemare-coordinator").spec.selector.matchLabels["app.kubernetes.io/component"] = "coordinater"; }],
  ["overlays/monitoring", "monitor", "the coordinator scraped through two Services", (o) => { find(o, "Service", "pipemare-coordinator-headless").spec.ports.push({ name: "metrics", port: 9460, targetPort: "metrics" }); }],
  ["overlays/monitoring", "monitor", "a PodMonitor port no container has", (o) => { find(o, "PodMonitor", "pipemare-worker").spec.podMetricsEndpoints[0].port = "prometheus"; }],
  ["overlays/monitoring", "monitor", "a PodMonitor selecting nothing", (o) => { find(o, "PodMonitor", "pipemare-worker").spec.selector.matchLabels["app.kubernetes.io/name"] = "pipemere"; }],
  ["overlays/monitoring", "dashboard", "the dashboard label Grafana's sidecar does not look for", (o) => { find(o, "ConfigMap", "pipemare-grafana-dashboard").metadata.labels.grafana_dashboard = "true"; }],
  ["overlays/monitoring", "dashboard", "a dashboard that is not JSON", (o) => { const cm = find(o, "ConfigMap", "pipemare-grafana-dashboard"); cm.data["pipemare.json"] = cm.data["pipemare.json"].slice(0, 100); }],
  ["overlays/cpu", "size", "a ConfigMap too large for kubectl apply", (o) => { find(o, "ConfigMap", "pipemare-examples").data.big = "x".repeat(300 * 1024); }],
  // The worker's addresses.
  ["overlays/cpu", "coordinator-address", "--coordinator names no Service", (o) => { setFlag(worker(o), "coordinator", "pipemare-coordinater:7070"); }],
  ["overlays/cpu", "coordinator-address", "--coordinator on a port the Service lacks", (o) => { setFlag(worker(o), "coordinator", "pipemare-coordinator:7071"); }],
  ["overlays/cpu", "coordinator-address", "--coordinator's Service port leads to the metrics port", (o) => { find(o, "Service", "pipemare-coordinator").spec.ports[0].targetPort = "metrics"; }],
  ["overlays/cpu", "coordinator-address", "--coordinator as a bare host", (o) => { setFlag(worker(o), "coordinator", "pipemare-coordinator"); }],
  ["overlays/cpu", "advertise", "advertising the pod IP", (o) => { setFlag(worker(o), "advertise", "$(POD_IP):7071"); }],
  ["overlays/cpu", "advertise", "advertising another port than --listen", (o) => { setFlag(worker(o), "advertise", "$(POD_NAME).pipemare-worker.$(POD_NAMESPACE).svc:7072"); }],
  ["overlays/cpu", "advertise", "POD_NAME from the wrong field", (o) => { worker(o).env.find((e) => e.name === "POD_NAME").valueFrom.fieldRef.fieldPath = "spec.nodeName"; }],
  ["overlays/cpu", "advertise", "the headless Service hides not-ready pods", (o) => { find(o, "Service", "pipemare-worker").spec.publishNotReadyAddresses = false; }],
  ["overlays/cpu", "env", "$(POD_NAMESPACE) with no such variable", (o) => { const c = worker(o); c.env = c.env.filter((e) => e.name !== "POD_NAMESPACE"); }],
  // Volumes, mounts, files.
  ["overlays/cpu", "volumes", "a Secret nobody makes", (o) => { volume(podSpec(o, "pipemare-coordinator"), "tls").secret.secretName = "pipemare-tls-certs"; }],
  ["overlays/cpu", "volumes", "a key the tokens Secret does not hold", (o) => { volume(podSpec(o, "pipemare-coordinator"), "tokens").secret.items[0].key = "token"; }],
  ["overlays/cpu", "volumes", "a PersistentVolumeClaim that is not rendered", (o) => { volume(podSpec(o, "pipemare-worker"), "data").persistentVolumeClaim.claimName = "pipemare-dat"; }],
  ["overlays/cpu", "volumes", "a ConfigMap that is not rendered", (o) => { podSpec(o, "pipemare-worker").volumes.push({ name: "x", configMap: { name: "pipemare-settings" } }); }],
  ["overlays/cpu", "mounts", "a volumeMount naming no volume", (o) => { mount(worker(o), "tmp").name = "temp"; }],
  ["overlays/cpu", "mounts", "an init container's volumeMount naming no volume", (o) => { podSpec(o, "pipemare-coordinator").initContainers = [{ ...clone(coordinator(o)), name: "init", volumeMounts: [{ name: "dat", mountPath: "/x" }] }]; }],
  ["overlays/cpu", "mounts", "two mounts at one path", (o) => { worker(o).volumeMounts.push({ name: "tmp", mountPath: "/data" }); }],
  ["overlays/cpu", "files", "--tls-key names a file the Secret volume does not project", (o) => { setFlag(worker(o), "tls-key", "/etc/pipemare/tls/worker-key.pem"); }],
  ["overlays/cpu", "files", "--tokens-file outside every volume", (o) => { setFlag(coordinator(o), "tokens-file", "/etc/pipemare/tokens.txt"); }],
  ["overlays/cpu", "files", "--state-dir outside every volume", (o) => { setFlag(coordinator(o), "state-dir", "/var/lib/pipemare-state"); }],
  ["overlays/cpu", "files", "--checkpoint-dir on a read-only mount", (o) => { mount(coordinator(o), "data").readOnly = true; }],
  ["overlays/cpu", "files", "no /tmp with a read-only root", (o) => { const c = worker(o); c.volumeMounts = c.volumeMounts.filter((m) => m.name !== "tmp"); }],
  ["overlays/cpu", "files", "TLS flags dropped without --insecure", (o) => { setFlag(worker(o), "tls-cert", null); }],
  ["overlays/cpu", "shared-checkpoints", "workers mount the data volume elsewhere", (o) => { mount(worker(o), "data").mountPath = "/mnt/data"; }],
  ["overlays/cpu", "shared-checkpoints", "workers mount a subPath of the data volume", (o) => { mount(worker(o), "data").subPath = "workers"; }],
  ["overlays/cpu", "example-spec", "the example spec drifted from examples/", (o) => { const cm = find(o, "ConfigMap", "pipemare-examples"); cm.data["mnist_pipemare.yaml"] = cm.data["mnist_pipemare.yaml"].replace("lr: 0.03", "lr: 0.3"); }],
  ["overlays/cpu", "example-spec", "the example's data outside --data-root", (o) => { const cm = find(o, "ConfigMap", "pipemare-examples"); cm.data["mnist_pipemare.yaml"] = cm.data["mnist_pipemare.yaml"].replace("path: /data/mnist", "path: /srv/mnist"); }],
  // Pod settings.
  ["overlays/cpu", "security", "runAsNonRoot dropped", (o) => { delete podSpec(o, "pipemare-worker").securityContext.runAsNonRoot; }],
  ["overlays/cpu", "security", "a writable root file system", (o) => { worker(o).securityContext.readOnlyRootFilesystem = false; }],
  ["overlays/cpu", "security", "an init container that may escalate privileges", (o) => { const c = clone(coordinator(o)); c.name = "init"; c.securityContext.allowPrivilegeEscalation = true; podSpec(o, "pipemare-coordinator").initContainers = [c]; }],
  ["overlays/cpu", "security", "capabilities kept", (o) => { delete coordinator(o).securityContext.capabilities; }],
  ["overlays/cpu", "security", "service links on", (o) => { delete podSpec(o, "pipemare-worker").enableServiceLinks; }],
  ["overlays/cpu", "security", "no memory limit", (o) => { delete worker(o).resources.limits.memory; }],
  ["overlays/cpu", "termination", "a grace period the drain does not fit in", (o) => { podSpec(o, "pipemare-worker").terminationGracePeriodSeconds = 30; }],
  ["overlays/cpu", "termination", "the worker's default --drain-timeout (30 s) with 40 s of grace", (o) => { setFlag(worker(o), "drain-timeout", null); }],
  ["overlays/cpu", "labels", "a selector that is not name + component", (o) => { const s = find(o, "StatefulSet", "pipemare-coordinator"); s.spec.selector.matchLabels["app.kubernetes.io/part-of"] = "pipemare"; }],
  ["overlays/cpu", "labels", "a selector the pod template does not match", (o) => { find(o, "StatefulSet", "pipemare-worker").spec.template.metadata.labels["app.kubernetes.io/component"] = "stage"; }],
  ["overlays/cpu", "labels", "an object without part-of", (o) => { delete find(o, "PersistentVolumeClaim", "pipemare-data").metadata.labels["app.kubernetes.io/part-of"]; }],
  ["overlays/gpu", "gpu", "a GPU worker left on --device cpu", (o) => { const c = worker(o); c.env = c.env.filter((e) => e.name !== "PIPEMARE_DEVICE"); }],
  ["overlays/gpu", "gpu", "a GPU worker without /dev/shm", (o) => { const c = worker(o); c.volumeMounts = c.volumeMounts.filter((m) => m.mountPath !== "/dev/shm"); }],
  ["overlays/cpu", "gpu", "--device cuda without a GPU", (o) => { worker(o).env.push({ name: "PIPEMARE_DEVICE", value: "cuda" }); }],
];

async function problemsOf(objects, repo) {
  return [...(await validateAll(objects)).map((p) => `[schema] ${p}`), ...checkObjects(objects, crossrefContext(repo))];
}

function run(argv, cwd) {
  const r = spawnSync(argv[0], argv.slice(1), { cwd, encoding: "utf8", maxBuffer: 256 << 20 });
  if (r.error) throw new Error(`cannot run ${argv[0]}: ${r.error.message}`);
  return r;
}

// Copies what the kustomizations read (deploy/) into a temporary directory
// laid out as the repository is.
function copyDeploy(repo) {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "pipemare-k8s-selftest-"));
  fs.cpSync(path.join(repo, "deploy"), path.join(tmp, "deploy"), { recursive: true });
  fs.mkdirSync(path.join(tmp, "examples"));
  fs.copyFileSync(path.join(repo, "examples/mnist_pipemare.yaml"), path.join(tmp, "examples/mnist_pipemare.yaml"));
  fs.copyFileSync(path.join(repo, ".yamllint"), path.join(tmp, ".yamllint"));
  return tmp;
}
function edit(file, from, to) {
  const text = fs.readFileSync(file, "utf8");
  if (!text.includes(from)) throw new Error(`self-test: ${file} has no "${from}" to break`);
  fs.writeFileSync(file, text.replace(from, to));
}

// File-level breaks in a copy of deploy/: [what, edit(copy), expected check].
const FILE_BREAKS = [
  ["a kustomization naming a missing resource", (t) => edit(path.join(t, "deploy/k8s/base/kustomization.yaml"), "  - worker.yaml", "  - workers.yaml"), "render"],
  ["an overlay whose base path is wrong", (t) => edit(path.join(t, "deploy/k8s/overlays/gpu/kustomization.yaml"), "  - ../cpu", "  - ../cpus"), "render"],
  ["the dashboard file renamed", (t) => fs.renameSync(path.join(t, "deploy/grafana/dashboards/pipemare.json"), path.join(t, "deploy/grafana/dashboards/x.json")), "render"],
  ["a misspelt field in worker.yaml", (t) => edit(path.join(t, "deploy/k8s/base/worker.yaml"), "readinessProbe:", "readinesProbe:"), "schema"],
  ["a GPU patch nesting resources wrongly", (t) => edit(path.join(t, "deploy/k8s/overlays/gpu/worker-gpu.yaml"), "          resources:\n            limits:", "          resources:\n            limit:"), "schema"],
  ["the data claim renamed in coordinator.yaml", (t) => edit(path.join(t, "deploy/k8s/base/coordinator.yaml"), "claimName: pipemare-data", "claimName: pipemare-dat"), "crossref"],
  ["the worker's --coordinator port in worker.yaml", (t) => edit(path.join(t, "deploy/k8s/base/worker.yaml"), "--coordinator=pipemare-coordinator:7070", "--coordinator=pipemare-coordinator:9460"), "crossref"],
  ["the monitors' port in monitors.yaml", (t) => edit(path.join(t, "deploy/k8s/overlays/monitoring/monitors.yaml"), "    - port: metrics", "    - port: metric"), "crossref"],
  ["trailing spaces and a duplicate key", (t) => edit(path.join(t, "deploy/k8s/base/data-pvc.yaml"), "spec:\n", "spec:   \n  accessModes: [ReadWriteOnce]\n"), "yamllint"],
  ["a tab-broken YAML file", (t) => fs.writeFileSync(path.join(t, "deploy/k8s/overlays/cpu/extra.yaml"), "a:\n\t- b\n"), "yamllint"],
];

async function checkCopy(tmp) {
  // Which checks fail on the copy: a subset of render, schema, crossref, yamllint.
  const failed = new Set();
  let renders = [];
  try {
    renders = renderAll(tmp);
  } catch (e) {
    failed.add("render");
  }
  if (renders.length && (await schemaProblems(renders)).length) failed.add("schema");
  if (renders.length && crossrefProblems(renders, tmp).length) failed.add("crossref");
  // Only the files this self-test breaks: the k8s.yamllint test lints all of deploy/.
  const lint = run([options.yamllint, "--strict", "-c", path.join(tmp, ".yamllint"), "deploy/k8s", "deploy/grafana"], tmp);
  if (lint.status !== 0) failed.add("yamllint");
  return failed;
}

async function selfTest(repo) {
  let bad = 0;
  const say = (ok, line) => {
    if (!ok) ++bad;
    console.log(`${ok ? "ok  " : "FAIL"} ${line}`);
  };
  // The renders as they are must pass, or nothing below means anything.
  const renders = new Map(renderAll(repo));
  for (const [dir, objects] of renders) {
    const problems = await problemsOf(objects, repo);
    say(problems.length === 0, `${dir} as committed passes${problems.length ? `: ${problems.join("; ")}` : ""}`);
  }
  const rules = new Set();
  for (const [dir, rule, what, mutate] of MUTATIONS) {
    const objects = clone(renders.get(dir));
    mutate(objects);
    const problems = await problemsOf(objects, repo);
    const hits = problems.filter((p) => p.startsWith(`[${rule}]`));
    rules.add(rule);
    say(hits.length > 0, `${dir}, ${what}: ${hits.length ? hits[0] : `no [${rule}] problem (got: ${problems.join("; ") || "none"})`}`);
  }
  // Every rule the crossref check reports has a mutation above.
  const source = fs.readFileSync(path.join(here, "lib/crossref.mjs"), "utf8");
  for (const m of source.matchAll(/fail\("([a-z-]+)"/g)) {
    if (!rules.has(m[1])) say(false, `crossref rule [${m[1]}] has no self-test mutation`);
  }
  // A flag given as --name value and through PIPEMARE_<NAME> reads the same.
  const flags = flagsOf({ command: ["pipemare-worker"], args: ["--listen", "0.0.0.0:1", "--threads=0"], env: [{ name: "PIPEMARE_DEVICE", value: "cuda" }] });
  say(flags.get("listen")?.[0] === "0.0.0.0:1" && flags.get("threads")?.[0] === "0" && flags.get("device")?.[0] === "cuda", "flags read from args (both forms) and PIPEMARE_* env");

  // Breaks of the files themselves, in a copy.
  const pristine = copyDeploy(repo);
  try {
    const failed = await checkCopy(pristine);
    say(failed.size === 0, `an unbroken copy of deploy/ passes${failed.size ? ` (failed: ${[...failed].join(", ")})` : ""}`);
  } finally {
    fs.rmSync(pristine, { recursive: true, force: true });
  }
  for (const [what, breakIt, expected] of FILE_BREAKS) {
    const tmp = copyDeploy(repo);
    try {
      breakIt(tmp);
      const failed = await checkCopy(tmp);
      say(failed.has(expected), `copy with ${what}: ${expected} ${failed.has(expected) ? "fails" : "PASSES"} (failed: ${[...failed].join(", ") || "none"})`);
    } finally {
      fs.rmSync(tmp, { recursive: true, force: true });
    }
  }
  console.log(bad ? `self-test: ${bad} check(s) did not behave` : "self-test: every break was caught");
  return bad ? 1 : 0;
}

// --- main --------------------------------------------------------------------

try {
  const repo = path.resolve(options.repo);
  if (modes[0] === "schema") {
    const renders = renderAll(repo);
    process.exitCode = report("schema", renders, await schemaProblems(renders));
  } else if (modes[0] === "crossref") {
    const renders = renderAll(repo);
    process.exitCode = report("crossref", renders, crossrefProblems(renders, repo));
  } else {
    process.exitCode = await selfTest(repo);
  }
} catch (e) {
  console.error(`check.mjs: ${e.message}`);
  process.exitCode = 1;
}
