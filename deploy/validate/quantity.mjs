// Byte sizes in the two notations the manifests mix: Kubernetes quantities
// (resources: 1536Mi, 2G) and layercast's --memory-budget (8GiB, 512MB).
const k8sUnits = { "": 1, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18,
  Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50, Ei: 2 ** 60 };

export function parseQuantity(text) {
  const m = /^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$/.exec(String(text));
  if (!m) throw new Error(`'${text}' is not a Kubernetes byte quantity`);
  return Number(m[1]) * k8sUnits[m[2] ?? ""];
}

// Mirrors platform/byte_size.cc: a decimal number, no space, optional suffix,
// Kubernetes' binary and decimal ones (up to T) included.
const budgetUnits = { "": 1, B: 1, KB: 1e3, MB: 1e6, GB: 1e9, TB: 1e12,
  KiB: 2 ** 10, MiB: 2 ** 20, GiB: 2 ** 30, TiB: 2 ** 40,
  Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, k: 1e3, M: 1e6, G: 1e9, T: 1e12 };

export function parseBudget(text) {
  const m = /^([0-9]+(?:\.[0-9]+)?)(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|Ki|Mi|Gi|Ti|k|M|G|T)?$/.exec(
    String(text));
  if (!m) throw new Error(`'${text}' is not a memory budget like 8GiB or 8Gi`);
  return Math.floor(Number(m[1]) * budgetUnits[m[2] ?? ""]);
}

export function formatBytes(n) {
  return `${(n / 2 ** 20).toFixed(0)}Mi`;
}
