#!/usr/bin/env node
// A small stand-in for the kubelet, for tests/deploy/run_rendered.sh: reads a
// rendered kustomization and, for every pod its StatefulSets and Deployments
// would make, prepares that pod's volumes in a work directory and writes one
// launcher script per container. run_rendered.sh wires the network and runs
// the launchers.
//
//   node pods.mjs --rendered FILE --work DIR --subnet 10.78.0 --bin-dir DIR \
//     --secret NAME=DIR ... [--seed CLAIM/SUBDIR=SRC ...] [--netns-prefix P]
//
// Writes in DIR:
//   plan.sh           bash declarations: pods, their addresses, network
//                     namespaces (P0, P1, ...), launchers, grace periods,
//                     probes, metrics ports, mount points, the address
//                     workers are given as --coordinator
//   hosts             /etc/hosts for every network namespace: each pod's
//                     DNS names under its headless Service and each
//                     ClusterIP Service's names (at its one pod's address)
//   pods/POD/CONTAINER.sh
//                     run as root inside the pod's network namespace under
//                     `unshare --mount`: mounts the volumes at the
//                     manifest's mountPaths, makes / read-only where
//                     readOnlyRootFilesystem says so, then execs the
//                     container's command + args (with $(VAR) expanded) with
//                     its environment only, as runAsUser/runAsGroup with
//                     fsGroup, no new privileges and no capabilities
//   volumes/, claims/ the volumes: Secrets from --secret directories (the
//                     keys as files, defaultMode, group fsGroup), ConfigMaps
//                     from the render, each PersistentVolumeClaim and claim
//                     template a directory (group fsGroup, setgid), emptyDirs
//   spec.yaml         the ConfigMap pipemare-examples' spec, cut short
//                     (train_limit, test_limit, one epoch) for a quick job
// Downward API values: metadata.name (pipemare-worker-0, ...),
// metadata.namespace, status.podIP (the pod's address in the subnet).
import fs from "node:fs";
import path from "node:path";
import yaml from "js-yaml";

const args = { secret: [], seed: [] };
for (let i = 2; i < process.argv.length; i += 2) {
  const key = process.argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
  const value = process.argv[i + 1];
  if (value === undefined) throw new Error(`${process.argv[i]} needs a value`);
  if (Array.isArray(args[key])) args[key].push(value);
  else args[key] = value;
}
for (const need of ["rendered", "work", "subnet", "binDir"]) {
  if (!args[need]) {
    console.error("usage: pods.mjs --rendered FILE --work DIR --subnet A.B.C --bin-dir DIR [--secret NAME=DIR]... [--seed CLAIM/SUBDIR=SRC]...");
    process.exit(2);
  }
}
const work = path.resolve(args.work);
const objects = yaml.loadAll(fs.readFileSync(args.rendered, "utf8")).filter(Boolean);
const secrets = Object.fromEntries(args.secret.map((s) => s.split("=")));

// Single-quoted for bash.
const q = (s) => `'${String(s).replace(/'/g, "'\\''")}'`;
const die = (why) => {
  throw new Error(why);
};

// $(VAR) expansion as the kubelet does it: $$ is a literal $, an unknown
// variable stays as written.
function expand(text, vars) {
  return String(text).replace(/\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, name) =>
    m === "$$" ? "$" : Object.prototype.hasOwnProperty.call(vars, name) ? vars[name] : m);
}

// The pods: StatefulSet pods NAME-0..N-1, in render order.
const pods = [];
for (const obj of objects) {
  if (obj.kind === "StatefulSet" || obj.kind === "Deployment") {
    const replicas = obj.spec.replicas ?? 1;
    for (let i = 0; i < replicas; ++i) {
      // StatefulSet pods are NAME-ORDINAL; a Deployment's get the same here.
      pods.push({ name: `${obj.metadata.name}-${i}`, ns: obj.metadata.namespace ?? "default", owner: obj, template: obj.spec.template });
    }
  } else if (["DaemonSet", "Job", "CronJob", "Pod", "ReplicaSet"].includes(obj.kind)) {
    die(`${obj.kind} ${obj.metadata.name}: not supported here`);
  }
}
pods.forEach((pod, i) => {
  pod.ip = `${args.subnet}.${i + 1}`;
  pod.netns = `${args.netnsPrefix ?? "pmk8s-"}${i}`;
});

const selects = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => (labels ?? {})[k] === v) && Object.keys(selector ?? {}).length > 0;

// The hosts file: pod names under their governing Service, Services' names.
const hosts = ["127.0.0.1 localhost"];
for (const svc of objects.filter((o) => o.kind === "Service")) {
  const ns = svc.metadata.namespace ?? "default";
  const names = (base) => [base, `${base}.${ns}`, `${base}.${ns}.svc`, `${base}.${ns}.svc.cluster.local`];
  const selected = pods.filter((p) => p.ns === ns && selects(svc.spec.selector, p.template.metadata.labels));
  if (svc.spec.clusterIP === "None") {
    for (const pod of selected) {
      if (pod.owner.kind === "StatefulSet" && pod.owner.spec.serviceName === svc.metadata.name) {
        hosts.push(`${pod.ip} ${names(`${pod.name}.${svc.metadata.name}`).join(" ")}`);
      }
    }
    if (selected.length) hosts.push(`${selected[0].ip} ${names(svc.metadata.name).join(" ")}`);
  } else {
    // A ClusterIP Service becomes its pod's address: only exact without a
    // second pod and without port translation.
    if (selected.length !== 1) die(`Service ${svc.metadata.name}: ${selected.length} pods; only one can stand in for a cluster IP here`);
    const containers = selected[0].template.spec.containers;
    for (const port of svc.spec.ports) {
      const target = port.targetPort ?? port.port;
      const cp = containers.flatMap((c) => c.ports ?? []).find((p) => p.containerPort === target || p.name === target);
      if (!cp || cp.containerPort !== port.port) die(`Service ${svc.metadata.name} port ${port.port} leads to ${target}: ports are not translated here`);
    }
    hosts.push(`${selected[0].ip} ${names(svc.metadata.name).join(" ")}`);
  }
}

const mkdir = (dir, mode = 0o755) => {
  fs.mkdirSync(dir, { recursive: true });
  fs.chmodSync(dir, mode);
  return dir;
};
// What the kubelet does to a volume for fsGroup: group-owned, group
// read-write, setgid directories.
function applyFsGroup(dir, gid) {
  if (gid === undefined) return;
  const walk = (p) => {
    const st = fs.lstatSync(p);
    fs.lchownSync(p, st.uid, gid);
    if (st.isDirectory()) {
      fs.chmodSync(p, (st.mode & 0o7777) | 0o2070);
      for (const entry of fs.readdirSync(p)) walk(path.join(p, entry));
    } else if (st.isFile()) {
      fs.chmodSync(p, (st.mode & 0o7777) | 0o060);
    }
  };
  walk(dir);
}

// Shared claims (by claim name) and per-pod claim templates.
const claimDir = (name) => path.join(work, "claims", name);
for (const seed of args.seed) {
  const [target, source] = seed.split("=");
  const [claim, ...sub] = target.split("/");
  const dest = path.join(claimDir(claim), ...sub);
  mkdir(path.dirname(dest));
  fs.cpSync(source, dest, { recursive: true, dereference: true });
}

const plan = { pods: [], mountpoints: new Set(), probes: [], metrics: [], coordinator: "" };
const lines = [];
for (const pod of pods) {
  const spec = pod.template.spec;
  const psc = spec.securityContext ?? {};
  const podDir = mkdir(path.join(work, "pods", pod.name));
  // Volumes: name -> {dir, tmpfs}.
  const volumes = new Map();
  for (const vol of spec.volumes ?? []) {
    const dir = path.join(work, "volumes", pod.name, vol.name);
    if (vol.secret || vol.configMap) {
      mkdir(dir);
      const mode = (vol.secret ?? vol.configMap).defaultMode ?? 0o644;
      let data;
      if (vol.secret) {
        const from = secrets[vol.secret.secretName] ?? die(`Secret ${vol.secret.secretName}: no --secret ${vol.secret.secretName}=DIR`);
        data = Object.fromEntries(fs.readdirSync(from).map((f) => [f, fs.readFileSync(path.join(from, f))]));
      } else {
        const cm = objects.find((o) => o.kind === "ConfigMap" && o.metadata.name === vol.configMap.name) ?? die(`ConfigMap ${vol.configMap.name} is not rendered`);
        data = cm.data ?? {};
      }
      const items = (vol.secret ?? vol.configMap).items ?? Object.keys(data).map((key) => ({ key, path: key }));
      for (const item of items) {
        if (!(item.key in data)) die(`${pod.name}: volume ${vol.name} has no key ${item.key}`);
        const file = path.join(dir, item.path);
        mkdir(path.dirname(file));
        fs.writeFileSync(file, data[item.key]);
        fs.chmodSync(file, item.mode ?? mode);
        if (psc.fsGroup !== undefined) fs.chownSync(file, 0, psc.fsGroup);
      }
      volumes.set(vol.name, { dir });
    } else if (vol.persistentVolumeClaim) {
      const dir = mkdir(claimDir(vol.persistentVolumeClaim.claimName), 0o775);
      volumes.set(vol.name, { dir });
    } else if (vol.emptyDir) {
      volumes.set(vol.name, { dir: mkdir(dir, 0o777), tmpfs: vol.emptyDir.medium === "Memory" ? vol.emptyDir.sizeLimit ?? "64Mi" : null });
    } else {
      die(`${pod.name}: volume ${vol.name} is of a kind not supported here`);
    }
  }
  for (const t of pod.owner.kind === "StatefulSet" ? pod.owner.spec.volumeClaimTemplates ?? [] : []) {
    volumes.set(t.metadata.name, { dir: mkdir(claimDir(`${t.metadata.name}-${pod.name}`), 0o775) });
  }
  for (const { dir, tmpfs } of volumes.values()) if (!tmpfs && psc.fsGroup !== undefined && dir.includes("/claims/")) applyFsGroup(dir, psc.fsGroup);

  const downward = { "metadata.name": pod.name, "metadata.namespace": pod.ns, "status.podIP": pod.ip, "spec.nodeName": "localhost" };
  const entry = { name: pod.name, ip: pod.ip, netns: pod.netns, grace: spec.terminationGracePeriodSeconds ?? 30, init: [], main: [] };
  for (const [kind, list] of [["init", spec.initContainers ?? []], ["main", spec.containers ?? []]]) {
    for (const c of list) {
      const sc = { ...psc, ...(c.securityContext ?? {}) };
      const env = {};
      for (const e of c.env ?? []) {
        if (e.value !== undefined) env[e.name] = expand(e.value, env);
        else if (e.valueFrom?.fieldRef) env[e.name] = downward[e.valueFrom.fieldRef.fieldPath] ?? die(`${pod.name}/${c.name}: env ${e.name}: fieldRef ${e.valueFrom.fieldRef.fieldPath} not supported here`);
        else die(`${pod.name}/${c.name}: env ${e.name}: valueFrom not supported here`);
      }
      const argv = [...(c.command ?? []), ...(c.args ?? [])].map((a) => expand(a, env));
      if (!c.command) die(`${pod.name}/${c.name}: no command (the image's entrypoint is not known here)`);
      // Mounts, parents first; a source must not lie under a mount path.
      const mounts = [...(c.volumeMounts ?? [])].sort((a, b) => a.mountPath.split("/").length - b.mountPath.split("/").length);
      const script = [
        "#!/bin/bash",
        `# ${pod.name}, ${kind} container ${c.name}: run by run_rendered.sh as root in network`,
        `# namespace ${pod.netns} under \`unshare --mount --propagation private\` (written by pods.mjs).`,
        "set -euo pipefail",
      ];
      for (const m of mounts) {
        const vol = volumes.get(m.name) ?? die(`${pod.name}/${c.name}: volumeMount ${m.name} names no volume`);
        for (const other of c.volumeMounts ?? []) {
          if (`${vol.dir}/`.startsWith(`${other.mountPath.replace(/\/+$/, "")}/`)) die(`work directory ${work} lies under mountPath ${other.mountPath}: use another`);
        }
        const source = m.subPath ? path.join(vol.dir, m.subPath) : vol.dir;
        if (!mounts.some((o) => o !== m && m.mountPath.startsWith(`${o.mountPath.replace(/\/+$/, "")}/`))) plan.mountpoints.add(m.mountPath);
        script.push(`[ -d ${q(m.mountPath)} ] || mkdir -p ${q(m.mountPath)}`);
        if (vol.tmpfs) {
          const size = String(vol.tmpfs).replace(/Gi$/, "g").replace(/Mi$/, "m");
          script.push(`mount -t tmpfs -o size=${q(size)},mode=1777 tmpfs ${q(m.mountPath)}`);
        } else {
          script.push(`mount --bind ${q(source)} ${q(m.mountPath)}`);
        }
        if (m.readOnly) script.push(`mount -o remount,bind,ro ${q(m.mountPath)}`);
      }
      if (sc.readOnlyRootFilesystem) script.push("mount -o remount,bind,ro /");
      script.push(`cd ${q(c.workingDir ?? "/")}`);
      const priv = ["setpriv"];
      if (sc.runAsUser !== undefined) priv.push(`--reuid=${sc.runAsUser}`);
      if (sc.runAsGroup !== undefined) priv.push(`--regid=${sc.runAsGroup}`);
      const groups = [...new Set([psc.fsGroup, ...(psc.supplementalGroups ?? [])].filter((g) => g !== undefined))];
      priv.push(groups.length ? `--groups=${groups.join(",")}` : "--clear-groups");
      if (sc.allowPrivilegeEscalation === false) priv.push("--no-new-privs");
      if ((sc.capabilities?.drop ?? []).includes("ALL")) priv.push("--inh-caps=-all", "--bounding-set=-all");
      if (sc.runAsNonRoot && !(sc.runAsUser > 0)) die(`${pod.name}/${c.name}: runAsNonRoot without a runAsUser`);
      // The image's environment: its PATH (here the build's bin directory
      // first) and its user's home (/var/lib/pipemare in docker/Dockerfile).
      const environment = { PATH: `${path.resolve(args.binDir)}:/usr/local/bin:/usr/bin:/bin`, HOME: "/var/lib/pipemare", ...env };
      script.push(`exec ${priv.join(" ")} env -i ${Object.entries(environment).map(([k, v]) => q(`${k}=${v}`)).join(" ")} \\\n  ${argv.map(q).join(" ")}`);
      const file = path.join(podDir, `${c.name}.sh`);
      fs.writeFileSync(file, `${script.join("\n")}\n`, { mode: 0o755 });
      entry[kind].push(file);
      if (kind === "main") {
        for (const p of c.ports ?? []) if (p.name === "metrics") plan.metrics.push(`${pod.name}|${pod.ip}:${p.containerPort}`);
        const at = argv.findIndex((a) => a === "--coordinator" || a.startsWith("--coordinator="));
        if (at >= 0 && !plan.coordinator) plan.coordinator = argv[at].includes("=") ? argv[at].split("=")[1] : argv[at + 1];
        for (const probeKind of ["startupProbe", "livenessProbe", "readinessProbe"]) {
          const p = c[probeKind];
          if (!p) continue;
          if (!p.grpc) die(`${pod.name}/${c.name}: ${probeKind} is not grpc: not supported here`);
          const budget = (p.initialDelaySeconds ?? 0) + (p.periodSeconds ?? 10) * (p.failureThreshold ?? 3);
          plan.probes.push([pod.name, c.name, probeKind, `${pod.ip}:${p.grpc.port}`, p.grpc.service ?? "", budget].join("|"));
        }
      }
    }
  }
  plan.pods.push(entry);
}

// The example spec, short: a few dozen steps.
const examples = objects.find((o) => o.kind === "ConfigMap" && o.metadata.name === "pipemare-examples");
if (examples) {
  const spec = yaml.load(examples.data["mnist_pipemare.yaml"]);
  spec.name = "k8s-rendered";
  spec.data = { ...spec.data, train_limit: 2560, test_limit: 1000 };
  spec.train = { ...spec.train, epochs: 1 };
  fs.writeFileSync(path.join(work, "spec.yaml"), yaml.dump(spec, { flowLevel: 1 }));
}

fs.writeFileSync(path.join(work, "hosts"), `${hosts.join("\n")}\n`);
const assoc = (name, key, value) => lines.push(`${name}[${q(key)}]=${q(value)}`);
lines.push("# Written by tests/deploy/pods.mjs", "pods=()", "declare -gA pod_ip pod_netns pod_grace pod_init pod_main");
for (const p of plan.pods) {
  lines.push(`pods+=(${q(p.name)})`);
  assoc("pod_ip", p.name, p.ip);
  assoc("pod_netns", p.name, p.netns);
  assoc("pod_grace", p.name, p.grace);
  assoc("pod_init", p.name, p.init.join(" "));
  assoc("pod_main", p.name, p.main.join(" "));
}
lines.push(`mountpoints=(${[...plan.mountpoints].sort().map(q).join(" ")})`);
lines.push(`probes=(${plan.probes.map(q).join(" ")})`);
lines.push(`metrics=(${plan.metrics.map(q).join(" ")})`);
lines.push(`coordinator_address=${q(plan.coordinator)}`);
fs.writeFileSync(path.join(work, "plan.sh"), `${lines.join("\n")}\n`);
