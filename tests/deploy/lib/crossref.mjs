// Cross-reference checks of one rendered kustomization: what a schema cannot
// see, because it spans fields or objects (a Service's selector and the pods,
// a probe's port and the container's ports and flags, a worker's
// --coordinator and the coordinator's Service, a volume and what it names...)
// or because only the API server or the cluster would notice later.
//
// checkObjects(objects, context) returns problems, each "[rule] what: why";
// the rule ids are what the self-test (check.mjs --self-test) expects.
import path from "node:path";
import { describe } from "./render.mjs";

// Objects the user creates (deploy/k8s/README.md), with the keys they hold.
export const USER_CREATED = {
  Secret: {
    "pipemare-tls": ["ca.pem", "coordinator.pem", "coordinator.key", "worker.pem", "worker.key"],
    "pipemare-tokens": ["tokens"],
  },
  ConfigMap: {},
  PersistentVolumeClaim: {},
};

// What each Pipemare program serves on its health port, and its flags'
// defaults that matter here.
const PROGRAMS = {
  "pipemare-coordinator": { ready: "pipemare.v1.Coordinator", drainTimeout: 20 },
  "pipemare-worker": { ready: "pipemare.v1.StageWorker", drainTimeout: 30 },
};
// A service exits at most this long after SIGTERM beyond --drain-timeout.
const STOP_SLACK_SECONDS = 10;
const LABEL_NAME = "app.kubernetes.io/name";
const LABEL_COMPONENT = "app.kubernetes.io/component";
const LABEL_PART_OF = "app.kubernetes.io/part-of";
const WORKLOAD_KINDS = new Set(["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"]);
// kubectl apply (client side) keeps the whole object in an annotation of
// at most 256 KiB.
const MAX_APPLIED_BYTES = 256 * 1024;

const nsOf = (obj) => obj?.metadata?.namespace ?? "";
const sameNs = (a, b) => nsOf(a) === nsOf(b);

export function selectorMatches(selector, labels) {
  if (!selector) return false;
  labels = labels ?? {};
  for (const [k, v] of Object.entries(selector.matchLabels ?? {})) if (labels[k] !== v) return false;
  for (const e of selector.matchExpressions ?? []) {
    const has = Object.prototype.hasOwnProperty.call(labels, e.key);
    const values = e.values ?? [];
    if (e.operator === "In" && !(has && values.includes(labels[e.key]))) return false;
    if (e.operator === "NotIn" && has && values.includes(labels[e.key])) return false;
    if (e.operator === "Exists" && !has) return false;
    if (e.operator === "DoesNotExist" && has) return false;
  }
  return Object.keys(selector.matchLabels ?? {}).length + (selector.matchExpressions ?? []).length > 0;
}

// Every pod template in the render: {owner, ns, labels, spec, claimTemplates}.
export function podTemplates(objects) {
  const pods = [];
  for (const obj of objects) {
    let template = null;
    if (WORKLOAD_KINDS.has(obj.kind)) template = obj.spec?.template;
    if (obj.kind === "CronJob") template = obj.spec?.jobTemplate?.spec?.template;
    if (obj.kind === "Pod") template = obj;
    if (!template) continue;
    pods.push({
      owner: obj,
      ns: nsOf(obj),
      labels: template.metadata?.labels ?? {},
      spec: template.spec ?? {},
      claimTemplates: (obj.kind === "StatefulSet" ? obj.spec?.volumeClaimTemplates ?? [] : [])
        .map((t) => t.metadata?.name),
    });
  }
  return pods;
}

const allContainers = (spec) => [...(spec.initContainers ?? []), ...(spec.containers ?? [])];

// The program a container runs: the base name of its command (or first arg).
export function programOf(container) {
  const argv = [...(container.command ?? []), ...(container.args ?? [])];
  return argv.length ? path.basename(String(argv[0])) : "";
}

// The flags a container passes its program: "--name=value", "--name value"
// and bare "--name" in command and args, then PIPEMARE_<NAME> variables with
// a literal value (every Pipemare flag reads one) for flags not given.
export function flagsOf(container) {
  const argv = [...(container.command ?? []), ...(container.args ?? [])].slice(1).map(String);
  const flags = new Map();
  const add = (name, value) => flags.set(name, [...(flags.get(name) ?? []), value]);
  for (let i = 0; i < argv.length; ++i) {
    const m = /^--([a-z0-9][a-z0-9-]*)(?:=(.*))?$/s.exec(argv[i]);
    if (!m) continue;
    if (m[2] !== undefined) add(m[1], m[2]);
    else if (i + 1 < argv.length && !argv[i + 1].startsWith("--")) add(m[1], argv[++i]);
    else add(m[1], "");
  }
  for (const env of container.env ?? []) {
    const m = /^PIPEMARE_([A-Z0-9_]+)$/.exec(env.name ?? "");
    if (!m || env.value === undefined) continue;
    const name = m[1].toLowerCase().replace(/_/g, "-");
    if (!flags.has(name)) add(name, env.value);
  }
  return flags;
}
const flag = (flags, name) => flags.get(name)?.[0];

function splitHostPort(address) {
  const at = String(address).lastIndexOf(":");
  if (at <= 0) return null;
  const port = Number(address.slice(at + 1));
  if (!Number.isInteger(port) || port < 1 || port > 65535) return null;
  return { host: address.slice(0, at).replace(/^\[(.*)\]$/, "$1"), port };
}

// A container port by number or name.
function containerPort(container, port) {
  return (container.ports ?? []).find((p) => p.containerPort === port || (typeof port === "string" && p.name === port));
}

// The mount of `container` that holds `file` (the longest mountPath above it).
function mountFor(container, file) {
  let best = null;
  for (const m of container.volumeMounts ?? []) {
    const root = m.mountPath.replace(/\/+$/, "");
    if ((file === root || file.startsWith(`${root}/`)) && (!best || root.length > best.mountPath.length)) {
      best = m;
    }
  }
  return best;
}

export function checkObjects(objects, context = {}) {
  const problems = [];
  const fail = (rule, obj, why) => problems.push(`[${rule}] ${typeof obj === "string" ? obj : describe(obj)}: ${why}`);
  const rendered = (kind, name, near) =>
    objects.find((o) => o.kind === kind && o.metadata?.name === name && (!near || sameNs(o, near)));
  const services = objects.filter((o) => o.kind === "Service");
  const pods = podTemplates(objects);
  const podsOf = (selectorLike, near, plain = false) =>
    pods.filter((p) => p.ns === nsOf(near) &&
      (plain ? selectorMatches({ matchLabels: selectorLike }, p.labels) : selectorMatches(selectorLike, p.labels)));

  // [labels] The recommended labels, and selectors that never change.
  for (const obj of objects) {
    const labels = obj.metadata?.labels ?? {};
    if (labels[LABEL_NAME] !== "pipemare") fail("labels", obj, `metadata.labels["${LABEL_NAME}"] is not "pipemare"`);
    if (labels[LABEL_PART_OF] !== "pipemare") fail("labels", obj, `metadata.labels["${LABEL_PART_OF}"] is not "pipemare"`);
  }
  for (const pod of pods) {
    for (const label of [LABEL_NAME, LABEL_COMPONENT, LABEL_PART_OF]) {
      if (!pod.labels[label]) fail("labels", pod.owner, `the pod template has no label ${label}`);
    }
    const selector = pod.owner.spec?.selector;
    if (pod.owner.kind !== "Pod" && pod.owner.kind !== "CronJob") {
      if (!selectorMatches(selector, pod.labels)) {
        fail("labels", pod.owner, "spec.selector does not match the pod template's labels");
      }
      const keys = Object.keys(selector?.matchLabels ?? {}).sort().join(",");
      if (keys !== [LABEL_COMPONENT, LABEL_NAME].sort().join(",") || selector?.matchExpressions?.length) {
        fail("labels", pod.owner, `spec.selector must be exactly matchLabels ${LABEL_NAME} + ${LABEL_COMPONENT} (selectors are immutable)`);
      }
    }
  }

  // [service-selector] A Service's selector selects pods, and its target
  // ports exist on them.
  for (const svc of services) {
    const selector = svc.spec?.selector;
    if (!selector || Object.keys(selector).length === 0) {
      fail("service-selector", svc, "no selector");
      continue;
    }
    const matched = podsOf(selector, svc, true);
    if (matched.length === 0) {
      fail("service-selector", svc, `selector ${JSON.stringify(selector)} matches no pod template`);
      continue;
    }
    for (const port of svc.spec?.ports ?? []) {
      const target = port.targetPort ?? port.port;
      for (const pod of matched) {
        if (!(pod.spec.containers ?? []).some((c) => containerPort(c, target))) {
          fail("service-selector", svc, `port ${port.name ?? port.port}: targetPort ${target} is no container port of ${describe(pod.owner)}`);
        }
      }
    }
  }

  // [statefulset-service] A StatefulSet's serviceName is a headless Service
  // selecting its pods.
  for (const sts of objects.filter((o) => o.kind === "StatefulSet")) {
    const svc = rendered("Service", sts.spec?.serviceName, sts);
    if (!svc) {
      fail("statefulset-service", sts, `serviceName ${sts.spec?.serviceName} names no rendered Service`);
    } else if (svc.spec?.clusterIP !== "None") {
      fail("statefulset-service", sts, `serviceName ${svc.metadata.name} is not headless (clusterIP: None)`);
    } else if (!selectorMatches({ matchLabels: svc.spec?.selector ?? {} }, sts.spec?.template?.metadata?.labels)) {
      fail("statefulset-service", sts, `Service ${svc.metadata.name} does not select its pods`);
    }
  }

  // [monitor] ServiceMonitors select Services that have their ports (exactly
  // one per port, or a target is scraped twice); PodMonitors select pods
  // whose containers have their ports.
  for (const mon of objects.filter((o) => o.kind === "ServiceMonitor")) {
    const matched = services.filter((s) => sameNs(s, mon) && selectorMatches(mon.spec?.selector, s.metadata?.labels));
    if (matched.length === 0) fail("monitor", mon, "its selector matches no Service");
    for (const ep of mon.spec?.endpoints ?? []) {
      const having = matched.filter((s) => (s.spec?.ports ?? []).some((p) => p.name === ep.port));
      if (matched.length && having.length === 0) fail("monitor", mon, `endpoint port ${ep.port} is on no selected Service`);
      if (having.length > 1) {
        fail("monitor", mon, `endpoint port ${ep.port} is on ${having.length} selected Services (${having.map((s) => s.metadata.name).join(", ")}): each pod scraped more than once`);
      }
    }
  }
  for (const mon of objects.filter((o) => o.kind === "PodMonitor")) {
    const matched = pods.filter((p) => p.ns === nsOf(mon) && selectorMatches(mon.spec?.selector, p.labels));
    if (matched.length === 0) fail("monitor", mon, "its selector matches no pod template");
    for (const ep of mon.spec?.podMetricsEndpoints ?? []) {
      for (const pod of matched) {
        if (!(pod.spec.containers ?? []).some((c) => (c.ports ?? []).some((p) => p.name === ep.port))) {
          fail("monitor", mon, `port ${ep.port} is no named container port of ${describe(pod.owner)}`);
        }
      }
    }
  }

  // [dashboard] Grafana's sidecar needs a label and JSON it can load.
  for (const cm of objects.filter((o) => o.kind === "ConfigMap" && o.metadata?.labels?.grafana_dashboard !== undefined)) {
    if (cm.metadata.labels.grafana_dashboard !== "1") fail("dashboard", cm, 'grafana_dashboard label is not "1"');
    const files = Object.entries(cm.data ?? {});
    if (files.length === 0) fail("dashboard", cm, "no dashboard in data");
    for (const [key, text] of files) {
      try {
        const dashboard = JSON.parse(text);
        if (!dashboard.uid || !Array.isArray(dashboard.panels)) fail("dashboard", cm, `${key}: no uid or panels`);
      } catch (e) {
        fail("dashboard", cm, `${key}: not JSON (${e.message})`);
      }
    }
  }
  for (const obj of objects.filter((o) => o.kind === "ConfigMap" || o.kind === "Secret")) {
    const bytes = Buffer.byteLength(JSON.stringify(obj));
    if (bytes > MAX_APPLIED_BYTES) fail("size", obj, `${bytes} bytes: too large for kubectl apply's last-applied annotation`);
  }

  // Per pod template and container.
  const coordinators = [];
  for (const pod of pods) {
    const spec = pod.spec;
    const owner = pod.owner;
    const volumes = new Map((spec.volumes ?? []).map((v) => [v.name, v]));

    // [volumes] What each volume names exists (rendered, or made by the
    // user), as do the keys it projects.
    for (const vol of spec.volumes ?? []) {
      const refs = [];
      if (vol.secret) refs.push(["Secret", vol.secret.secretName, vol.secret.items]);
      if (vol.configMap) refs.push(["ConfigMap", vol.configMap.name, vol.configMap.items]);
      if (vol.persistentVolumeClaim) refs.push(["PersistentVolumeClaim", vol.persistentVolumeClaim.claimName, null]);
      for (const source of vol.projected?.sources ?? []) {
        if (source.secret) refs.push(["Secret", source.secret.name, source.secret.items]);
        if (source.configMap) refs.push(["ConfigMap", source.configMap.name, source.configMap.items]);
      }
      for (const [kind, name, items] of refs) {
        const obj = rendered(kind, name, owner);
        const userKeys = USER_CREATED[kind]?.[name];
        if (!obj && !userKeys) {
          fail("volumes", owner, `volume ${vol.name}: ${kind} ${name} is neither rendered nor made by the user (${Object.keys(USER_CREATED[kind] ?? {}).join(", ") || "none"})`);
          continue;
        }
        const keys = obj ? Object.keys({ ...(obj.data ?? {}), ...(obj.binaryData ?? {}), ...(obj.stringData ?? {}) }) : userKeys;
        for (const item of items ?? []) {
          if (!keys.includes(item.key)) fail("volumes", owner, `volume ${vol.name}: ${kind} ${name} has no key ${item.key}`);
        }
      }
    }
    // [mounts] Every volumeMount names a volume (or a claim template); no
    // two at one path.
    for (const c of allContainers(spec)) {
      const seen = new Set();
      for (const m of c.volumeMounts ?? []) {
        if (!volumes.has(m.name) && !pod.claimTemplates.includes(m.name)) {
          fail("mounts", owner, `container ${c.name}: volumeMount ${m.name} names no volume`);
        }
        if (seen.has(m.mountPath)) fail("mounts", owner, `container ${c.name}: two volumeMounts at ${m.mountPath}`);
        seen.add(m.mountPath);
      }
    }
    // What a path inside a container is: {mount, volume kind, writable, files}.
    const pathIn = (c, file) => {
      const mount = mountFor(c, file);
      if (!mount) return null;
      const vol = volumes.get(mount.name);
      const claim = vol?.persistentVolumeClaim?.claimName ?? (pod.claimTemplates.includes(mount.name) ? `template:${mount.name}` : null);
      let files = null;  // for Secret and ConfigMap volumes: the file names
      const source = vol?.secret ?? vol?.configMap;
      if (source) {
        const kind = vol.secret ? "Secret" : "ConfigMap";
        const name = vol.secret ? source.secretName : source.name;
        const obj = rendered(kind, name, owner);
        files = source.items ? source.items.map((i) => i.path) : obj ? Object.keys(obj.data ?? {}) : USER_CREATED[kind]?.[name] ?? [];
      }
      const relative = path.posix.relative(mount.mountPath, file);
      return {
        mount, claim, files, relative: mount.subPath ? path.posix.join(mount.subPath, relative) : relative,
        writable: !mount.readOnly && !source && !vol?.downwardAPI,
        persistent: claim !== null,
      };
    };

    // [security] The restricted Pod Security Standard and then some.
    const psc = spec.securityContext ?? {};
    if (psc.runAsNonRoot !== true) fail("security", owner, "securityContext.runAsNonRoot is not true");
    for (const key of ["runAsUser", "runAsGroup", "fsGroup"]) {
      if (psc[key] !== 10001) fail("security", owner, `securityContext.${key} is not 10001 (the image's pipemare user)`);
    }
    if (psc.seccompProfile?.type !== "RuntimeDefault") fail("security", owner, "securityContext.seccompProfile.type is not RuntimeDefault");
    if (spec.automountServiceAccountToken !== false) fail("security", owner, "automountServiceAccountToken is not false (no Pipemare service uses the Kubernetes API)");
    if (spec.enableServiceLinks !== false) {
      fail("security", owner, "enableServiceLinks is not false: service links put PIPEMARE_* variables in the environment, and every Pipemare flag reads one");
    }
    for (const c of allContainers(spec)) {
      const sc = c.securityContext ?? {};
      if (sc.allowPrivilegeEscalation !== false) fail("security", owner, `container ${c.name}: allowPrivilegeEscalation is not false`);
      if (sc.readOnlyRootFilesystem !== true) fail("security", owner, `container ${c.name}: readOnlyRootFilesystem is not true`);
      if (!(sc.capabilities?.drop ?? []).includes("ALL")) fail("security", owner, `container ${c.name}: capabilities.drop lacks ALL`);
      if (sc.privileged) fail("security", owner, `container ${c.name}: privileged`);
      for (const what of ["requests", "limits"]) {
        for (const r of ["cpu", "memory"]) {
          if (c.resources?.[what]?.[r] === undefined) fail("security", owner, `container ${c.name}: no resources.${what}.${r}`);
        }
      }
    }

    for (const c of allContainers(spec)) {
      const where = `${describe(owner)} container ${c.name}`;
      const env = new Map((c.env ?? []).map((e) => [e.name, e]));

      // [env] Every $(VAR) in command, args and env is a variable of the
      // container (Kubernetes leaves an unknown one as literal text).
      const defined = new Set();
      for (const e of c.env ?? []) {
        for (const m of String(e.value ?? "").matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
          if (!defined.has(m[1])) fail("env", where, `env ${e.name} uses $(${m[1]}) before it is defined`);
        }
        defined.add(e.name);
      }
      for (const arg of [...(c.command ?? []), ...(c.args ?? [])]) {
        for (const m of String(arg).matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
          if (!env.has(m[1])) fail("env", where, `"${arg}" uses $(${m[1]}), which is not in env`);
        }
      }

      const program = programOf(c);
      const known = PROGRAMS[program];
      if (!known) continue;
      const flags = flagsOf(c);
      if (program === "pipemare-coordinator") coordinators.push({ pod, c, flags, pathIn });

      // [ports] Each --*listen port is a named container port and each
      // container port is listened on.
      const listening = new Map();
      for (const [name, values] of flags) {
        if (!name.endsWith("listen")) continue;
        for (const v of values) {
          const hp = splitHostPort(v);
          if (!hp) {
            fail("ports", where, `--${name} ${v} is not host:port`);
          } else {
            listening.set(hp.port, name);
            const p = containerPort(c, hp.port);
            if (!p) fail("ports", where, `--${name} port ${hp.port} is no container port`);
          }
        }
      }
      for (const p of c.ports ?? []) {
        if (!listening.has(p.containerPort)) fail("ports", where, `container port ${p.name ?? ""} ${p.containerPort} is not one the program listens on`);
      }

      // [probes] The probes' ports exist on the container and are the
      // --health-listen port, and ask the right gRPC service.
      const health = splitHostPort(flag(flags, "health-listen") ?? "");
      for (const kind of ["startupProbe", "livenessProbe", "readinessProbe"]) {
        const probe = c[kind];
        if (!probe) {
          fail("probes", where, `no ${kind}`);
          continue;
        }
        const action = probe.grpc ?? probe.httpGet ?? probe.tcpSocket;
        if (!probe.grpc) fail("probes", where, `${kind} is not a grpc probe`);
        if (!action) continue;
        const p = containerPort(c, action.port);
        if (!p) {
          fail("probes", where, `${kind} port ${action.port} is no container port`);
        } else if (!health || p.containerPort !== health.port) {
          fail("probes", where, `${kind} port ${action.port} is not the --health-listen port (${health?.port ?? "none"})`);
        }
        if (probe.grpc) {
          const want = kind === "readinessProbe" ? known.ready : "";
          if ((probe.grpc.service ?? "") !== want) fail("probes", where, `${kind} asks for service "${probe.grpc.service ?? ""}", not "${want}"`);
        }
      }

      // [termination] The pod waits for the drain: a service exits at most
      // --drain-timeout + 10 s after SIGTERM.
      const drain = Number(flag(flags, "drain-timeout") ?? known.drainTimeout);
      const grace = spec.terminationGracePeriodSeconds ?? 30;
      if (!(grace > drain + STOP_SLACK_SECONDS)) {
        fail("termination", where, `terminationGracePeriodSeconds ${grace} is not above --drain-timeout ${drain} + ${STOP_SLACK_SECONDS}`);
      }

      // [files] The TLS and token files are mounted (not the image's), and
      // are files the mount projects.
      for (const name of ["tls-ca", "tls-cert", "tls-key", "tokens-file"]) {
        const file = flag(flags, name);
        if (file === undefined) continue;
        const at = pathIn(c, file);
        if (!at) {
          fail("files", where, `--${name} ${file} is on no volume`);
        } else if (at.files && !at.files.includes(at.relative)) {
          fail("files", where, `--${name} ${file}: volume ${at.mount.name} holds ${at.files.join(", ") || "nothing"}, not ${at.relative}`);
        }
      }
      if (!flags.has("insecure") && (!flags.has("tls-ca") || !flags.has("tls-cert") || !flags.has("tls-key"))) {
        fail("files", where, "neither --insecure nor all of --tls-ca, --tls-cert, --tls-key");
      }
      if (program === "pipemare-coordinator" && flags.has("tls-cert") && !flags.has("tokens-file")) {
        fail("files", where, "TLS without --tokens-file");
      }
      // Writable directories on persistent volumes; /tmp writable where the
      // root file system is read-only.
      for (const name of ["state-dir", "checkpoint-dir"]) {
        const dir = flag(flags, name);
        if (dir === undefined) continue;
        const at = pathIn(c, dir);
        if (!at || !at.writable || !at.persistent) fail("files", where, `--${name} ${dir} is not on a writable persistent volume`);
      }
      for (const dir of flags.get("data-root") ?? []) {
        if (!pathIn(c, dir)) fail("files", where, `--data-root ${dir} is on no volume`);
      }
      if (c.securityContext?.readOnlyRootFilesystem && !pathIn(c, "/tmp")?.writable) {
        fail("files", where, "the root file system is read-only and /tmp is no writable volume");
      }

      // [gpu] A GPU is asked for exactly where --device is cuda.
      const gpus = Number(c.resources?.limits?.["nvidia.com/gpu"] ?? 0);
      const device = flag(flags, "device") ?? "cpu";
      if (gpus > 0 && !device.startsWith("cuda")) fail("gpu", where, `nvidia.com/gpu ${gpus} but --device ${device}`);
      if (gpus === 0 && device.startsWith("cuda")) fail("gpu", where, `--device ${device} but no nvidia.com/gpu limit`);
      if (gpus > 0 && !pathIn(c, "/dev/shm")) fail("gpu", where, "a GPU worker without a /dev/shm volume (the runtime's is 64 MiB)");

      // [coordinator-address] A worker's --coordinator is a Service port that
      // leads to a coordinator's --listen port.
      const coordinator = flag(flags, "coordinator");
      if (program === "pipemare-worker") {
        const hp = splitHostPort(coordinator ?? "");
        const svc = hp && services.find((s) => sameNs(s, owner) &&
          [s.metadata.name, `${s.metadata.name}.${nsOf(owner) || "NAMESPACE"}`, `${s.metadata.name}.${nsOf(owner) || "NAMESPACE"}.svc`]
            .includes(hp.host.replace(/\.cluster\.local$/, "")));
        const port = svc && (svc.spec?.ports ?? []).find((p) => p.port === hp.port);
        if (!hp) {
          fail("coordinator-address", where, `--coordinator ${coordinator} is not host:port`);
        } else if (!svc) {
          fail("coordinator-address", where, `--coordinator ${coordinator}: ${hp.host} names no rendered Service`);
        } else if (!port) {
          fail("coordinator-address", where, `--coordinator ${coordinator}: Service ${svc.metadata.name} has no port ${hp.port}`);
        } else {
          const target = port.targetPort ?? port.port;
          const reached = podsOf(svc.spec?.selector ?? {}, svc, true).flatMap((p) => p.spec.containers ?? [])
            .filter((cc) => programOf(cc) === "pipemare-coordinator")
            .filter((cc) => {
              const cp = containerPort(cc, target);
              const listen = splitHostPort(flag(flagsOf(cc), "listen") ?? "");
              return cp && listen && cp.containerPort === listen.port;
            });
          if (reached.length === 0) {
            fail("coordinator-address", where, `--coordinator ${coordinator}: Service ${svc.metadata.name} port ${hp.port} leads to no coordinator's --listen port`);
          }
        }
        // [advertise] The advertised name is the pod's own name under the
        // StatefulSet's headless Service (which publishes it before the pod
        // is ready), on the --listen port.
        const advertise = flag(flags, "advertise") ?? "";
        const adv = splitHostPort(advertise);
        const governing = owner.kind === "StatefulSet" ? rendered("Service", owner.spec?.serviceName, owner) : null;
        const fieldRef = (name) => env.get(name)?.valueFrom?.fieldRef?.fieldPath;
        const listen = splitHostPort(flag(flags, "listen") ?? "");
        if (!adv) {
          fail("advertise", where, `--advertise ${advertise} is not host:port`);
        } else {
          const want = `$(POD_NAME).${owner.spec?.serviceName}.$(POD_NAMESPACE).svc`;
          if (adv.host !== want) fail("advertise", where, `--advertise host ${adv.host} is not ${want}`);
          if (fieldRef("POD_NAME") !== "metadata.name") fail("advertise", where, "POD_NAME is not from fieldRef metadata.name");
          if (fieldRef("POD_NAMESPACE") !== "metadata.namespace") fail("advertise", where, "POD_NAMESPACE is not from fieldRef metadata.namespace");
          if (!listen || adv.port !== listen.port) fail("advertise", where, `--advertise port ${adv.port} is not the --listen port`);
          if (!governing || governing.spec?.publishNotReadyAddresses !== true) {
            fail("advertise", where, `Service ${owner.spec?.serviceName} does not publish not-ready addresses: a worker is dialled at its name before it is ready`);
          }
        }
      }
    }
  }

  // [shared-checkpoints] Every worker reaches the coordinator's checkpoint
  // directory at the same path, on the same volume.
  for (const { pod, c, flags, pathIn } of coordinators) {
    const dir = flag(flags, "checkpoint-dir");
    if (dir === undefined) {
      fail("shared-checkpoints", pod.owner, "no --checkpoint-dir");
      continue;
    }
    const at = pathIn(c, dir);
    for (const worker of pods.filter((p) => p.ns === pod.ns)) {
      for (const wc of worker.spec.containers ?? []) {
        if (programOf(wc) !== "pipemare-worker") continue;
        const mount = mountFor(wc, dir);
        const vol = mount && (worker.spec.volumes ?? []).find((v) => v.name === mount.name);
        const claim = vol?.persistentVolumeClaim?.claimName;
        const relative = mount && path.posix.join(mount.subPath ?? "", path.posix.relative(mount.mountPath, dir));
        if (!at?.claim || claim !== at.claim || relative !== at.relative || mount.readOnly) {
          fail("shared-checkpoints", worker.owner, `container ${wc.name} does not reach the coordinator's --checkpoint-dir ${dir} (PersistentVolumeClaim ${at?.claim}) writable at the same path`);
        }
      }
    }
  }

  // [example-spec] The example job spec is examples/mnist_pipemare.yaml
  // with its data on the data volume, under the coordinator's --data-root.
  const example = objects.find((o) => o.kind === "ConfigMap" && o.metadata?.name === "pipemare-examples");
  if (example && context.exampleSpec && context.parseYaml) {
    const spec = context.parseYaml(example.data?.["mnist_pipemare.yaml"] ?? "");
    const { data: ours, ...oursRest } = spec ?? {};
    const { data: theirs, ...theirsRest } = context.exampleSpec;
    const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
    if (!same(oursRest, theirsRest) || !same({ ...ours, path: undefined }, { ...theirs, path: undefined })) {
      fail("example-spec", example, "mnist_pipemare.yaml differs from examples/mnist_pipemare.yaml in more than data.path");
    }
    for (const { c, flags, pathIn } of coordinators) {
      const roots = flags.get("data-root") ?? [];
      const p = ours?.path ?? "";
      if (!roots.some((r) => p === r || p.startsWith(`${r.replace(/\/+$/, "")}/`)) || !pathIn(c, p)?.persistent) {
        fail("example-spec", example, `data.path ${p} is not under the coordinator's --data-root (${roots.join(", ")}) on a volume`);
      }
    }
  }
  if (context.expectExample && !example) fail("example-spec", "render", "no ConfigMap pipemare-examples");
  return problems;
}
