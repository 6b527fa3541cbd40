// Schema validation of rendered objects with kubernetes-models (Kubernetes'
// OpenAPI schemas compiled to ajv validators) and
// @kubernetes-models/prometheus-operator (the monitoring.coreos.com CRDs).
//
// Those validators check types, enums and required fields but accept unknown
// fields (the schemas carry no additionalProperties: false, and the
// API server's own pruning is what drops them). A misspelt or misplaced
// field (`readinesProbe`, `resources` one level too deep) would pass, so
// unknown fields are found here too: the validator is run on a Proxy of the
// object that records which properties it looks up. A compiled validator
// looks up every property its schema declares (to check it, present or not),
// and enumerates the keys of a map (additionalProperties: labels, limits...);
// so a key it never looked up, in an object whose keys it did look up, is
// not in the schema. An object whose schema declares nothing (free-form, e.g.
// x-kubernetes-preserve-unknown-fields) has no key looked up and is skipped.
import { describe } from "./render.mjs";

// The module holding the model class of an apiVersion.
async function modelModule(apiVersion) {
  const candidates = [`kubernetes-models/${apiVersion}`];
  if (apiVersion.startsWith("monitoring.coreos.com/")) {
    candidates.unshift(`@kubernetes-models/prometheus-operator/${apiVersion}`);
  }
  for (const name of candidates) {
    try {
      return await import(name);
    } catch (e) {
      if (e.code !== "ERR_PACKAGE_PATH_NOT_EXPORTED" && e.code !== "ERR_MODULE_NOT_FOUND") throw e;
    }
  }
  return null;
}

export async function modelFor(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string") return null;
  const mod = await modelModule(apiVersion);
  const model = mod?.[kind];
  return typeof model === "function" && model.kind === kind ? model : null;
}

// A deep Proxy of `root` and, for every object reached through it, the keys
// looked up and whether its keys were enumerated.
function track(root) {
  const records = new Map();
  const proxies = new WeakMap();
  const wrap = (value) => {
    if (value === null || typeof value !== "object") return value;
    if (proxies.has(value)) return proxies.get(value);
    const record = { keys: new Set(), enumerated: false };
    records.set(value, record);
    const proxy = new Proxy(value, {
      get(target, key, receiver) {
        if (typeof key === "string") record.keys.add(key);
        return wrap(Reflect.get(target, key, receiver));
      },
      has(target, key) {
        if (typeof key === "string") record.keys.add(key);
        return Reflect.has(target, key);
      },
      getOwnPropertyDescriptor(target, key) {
        if (typeof key === "string") record.keys.add(key);
        return Reflect.getOwnPropertyDescriptor(target, key);
      },
      ownKeys(target) {
        record.enumerated = true;
        return Reflect.ownKeys(target);
      },
    });
    proxies.set(value, proxy);
    return proxy;
  };
  return { proxy: wrap(root), records };
}

function unknownFields(value, records, where, out) {
  if (value === null || typeof value !== "object") return;
  if (Array.isArray(value)) {
    value.forEach((item, i) => unknownFields(item, records, `${where}[${i}]`, out));
    return;
  }
  const record = records.get(value);
  if (!record) return;  // never reached by the validator: reported at its parent
  const free = record.keys.size === 0 && !record.enumerated;
  for (const key of Object.keys(value)) {
    const at = where ? `${where}.${key}` : key;
    if (!free && !record.enumerated && !record.keys.has(key)) {
      out.push(`${at}: unknown field`);
      continue;
    }
    unknownFields(value[key], records, at, out);
  }
}

// The problems of one object: "" entries never; each names the object.
export async function validateObject(obj) {
  const what = describe(obj);
  const model = await modelFor(obj?.apiVersion, obj?.kind);
  if (!model) return [`${what}: no schema for apiVersion ${obj?.apiVersion} kind ${obj?.kind}`];
  const { proxy, records } = track(obj);
  const problems = [];
  try {
    // The model's validate() runs the compiled validator on `this`.
    model.prototype.validate.call(proxy);
  } catch (e) {
    if (!e.errors && !/^data/.test(e.message)) throw e;
    return [`${what}: schema: ${e.message}`];
  }
  const unknown = [];
  unknownFields(obj, records, "", unknown);
  for (const u of unknown) problems.push(`${what}: schema: ${u}`);
  return problems;
}

export async function validateAll(objects) {
  const problems = [];
  for (const obj of objects) problems.push(...(await validateObject(obj)));
  return problems;
}
