#!/usr/bin/env node
// Validates rendered manifests (the output of `kubectl kustomize`) offline:
// schemas from the bundled Kubernetes and Prometheus Operator models, strict
// about unknown field names, plus layercast's cross-object checks.
//   node validate.mjs --repo ROOT [--shard-binary layercast-shard] RENDERED.yaml...
// Exits 1 if any object fails, printing one line per problem.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import YAML from "yaml";
import { checkSchemas } from "./schema.mjs";
import { checkCrossObject } from "./cross.mjs";

// Parses a multi-document YAML stream; YAML errors (duplicate keys...) throw.
export function parseDocs(text) {
  return YAML.parseAllDocuments(text, { uniqueKeys: true }).map((doc) => {
    if (doc.errors.length) throw new Error(doc.errors.map((e) => e.message).join("; "));
    return doc.toJS();
  }).filter((d) => d !== null);
}

export async function validateDocs(docs, { repoRoot, shardBinary }) {
  const errors = await checkSchemas(docs);
  try {
    errors.push(...checkCrossObject(docs, { repoRoot, shardBinary }));
  } catch (e) {
    // A malformed object can break a check's assumptions; that is a failure too.
    errors.push(`cross-object checks stopped: ${e.message}`);
  }
  return errors;
}

async function main(argv) {
  let repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
  const files = [];
  let shardBinary;
  for (let i = 0; i < argv.length; ++i) {
    if (argv[i] === "--repo") repoRoot = argv[++i];
    else if (argv[i] === "--shard-binary") shardBinary = argv[++i];
    else files.push(argv[i]);
  }
  let failed = 0;
  for (const file of files) {
    const docs = parseDocs(fs.readFileSync(file, "utf8"));
    const errors = await validateDocs(docs, { repoRoot, shardBinary });
    const kinds = docs.map((d) => `${d.kind}/${d.metadata?.name}`).join(", ");
    console.log(`${file}: ${docs.length} objects (${kinds})`);
    for (const e of errors) console.log(`  FAIL ${e}`);
    if (errors.length) failed += 1;
    else console.log(`  ok: schemas (validate() + strict field names) and cross-object checks`);
  }
  process.exit(failed ? 1 : 0);
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  await main(process.argv.slice(2));
}
