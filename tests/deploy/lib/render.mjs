// Renders the kustomizations under deploy/k8s with `kubectl kustomize` (the
// kustomize built into kubectl, offline) and parses the output.
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import yaml from "js-yaml";

// The directories to render, relative to `k8sDir` (deploy/k8s): the base and
// every overlay that has a kustomization.
export function kustomizations(k8sDir) {
  const dirs = ["base"];
  const overlays = path.join(k8sDir, "overlays");
  for (const name of fs.readdirSync(overlays).sort()) {
    if (fs.existsSync(path.join(overlays, name, "kustomization.yaml"))) dirs.push(`overlays/${name}`);
  }
  return dirs;
}

// `kubectl kustomize DIR`; throws with kubectl's message when it fails.
export function renderText(kubectl, dir) {
  const r = spawnSync(kubectl, ["kustomize", dir], { encoding: "utf8", maxBuffer: 256 << 20 });
  if (r.error) throw new Error(`cannot run ${kubectl}: ${r.error.message}`);
  if (r.status !== 0) throw new Error(`kubectl kustomize ${dir} failed: ${r.stderr.trim()}`);
  return r.stdout;
}

// The rendered objects, in kustomize's order.
export function render(kubectl, dir) {
  return yaml.loadAll(renderText(kubectl, dir)).filter((o) => o !== null && o !== undefined);
}

export function describe(obj) {
  const ns = obj?.metadata?.namespace ? `${obj.metadata.namespace}/` : "";
  return `${obj?.kind ?? "?"} ${ns}${obj?.metadata?.name ?? "?"}`;
}
