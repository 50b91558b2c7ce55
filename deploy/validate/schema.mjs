// Schema checks for rendered Kubernetes objects, from the schemas bundled in
// the npm packages kubernetes-models and @kubernetes-models/prometheus-operator.
//
// Two passes, because neither alone is strict enough:
//  1. the models' validate(): JSON-schema types, enums, required fields;
//     but it lets unknown (e.g. misspelled) field names through.
//  2. TypeScript: every object becomes an object literal typed with the
//     model's interface; excess-property checking rejects any field name the
//     interface lacks, at any depth.
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import ts from "typescript";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);

// apiVersion/kind -> module specifier of its model (class and interface).
function modelModule(apiVersion, kind) {
  if (!/^[A-Za-z0-9]+$/.test(kind) || !/^[a-z0-9.\-]+\/?[a-z0-9]*$/.test(apiVersion)) return null;
  if (apiVersion.startsWith("monitoring.coreos.com/")) {
    return `@kubernetes-models/prometheus-operator/${apiVersion}/${kind}`;
  }
  return `kubernetes-models/${apiVersion}/${kind}`;
}

function resolvable(spec) {
  try {
    require.resolve(spec);
    return true;
  } catch {
    return false;
  }
}

function describe(doc) {
  return `${doc?.kind ?? "?"}/${doc?.metadata?.name ?? "?"}`;
}

// Pass 1: the models' own validate().
async function validateWithModels(docs) {
  const errors = [];
  for (const doc of docs) {
    const spec = modelModule(String(doc?.apiVersion ?? ""), String(doc?.kind ?? ""));
    if (!spec || !resolvable(spec)) {
      errors.push(`${describe(doc)}: no schema for apiVersion ${doc?.apiVersion} kind ${doc?.kind}`);
      continue;
    }
    const mod = await import(spec);
    const Model = mod[doc.kind];
    try {
      new Model(doc).validate();
    } catch (e) {
      const details = (e.errors ?? []).map((d) => `${d.instancePath || "/"} ${d.message}`);
      errors.push(`${describe(doc)}: schema: ${details.length ? details.join("; ") : e.message}`);
    }
  }
  return errors;
}

// Pass 2: type-check the objects as TypeScript literals. The source lives in
// memory at a path inside this folder so that node_modules resolves.
const virtualFile = path.join(here, "__rendered_objects__.ts");
const options = {
  strict: true,
  noEmit: true,
  skipLibCheck: true,
  types: [],
  lib: ["lib.es2022.d.ts"],
  target: ts.ScriptTarget.ES2022,
  module: ts.ModuleKind.NodeNext,
  moduleResolution: ts.ModuleResolutionKind.NodeNext,
};
const sourceCache = new Map(); // library .d.ts files parsed once per process

function typeCheck(docs) {
  const lines = [];
  const owner = []; // line number -> doc index
  docs.forEach((doc, i) => {
    const spec = modelModule(String(doc?.apiVersion ?? ""), String(doc?.kind ?? ""));
    if (!spec || !resolvable(spec)) return; // reported by pass 1
    const body = `import type { I${doc.kind} as T${i} } from "${spec}";\n` +
      `export const object${i}: T${i} = ${JSON.stringify(doc, null, 2)};\n`;
    for (const line of body.split("\n")) {
      lines.push(line);
      owner.push(i);
    }
  });
  const text = lines.join("\n");
  const host = ts.createCompilerHost(options);
  const getSourceFile = host.getSourceFile.bind(host);
  host.getSourceFile = (name, languageVersion, ...rest) => {
    if (name === virtualFile) return ts.createSourceFile(name, text, languageVersion);
    if (!sourceCache.has(name)) sourceCache.set(name, getSourceFile(name, languageVersion, ...rest));
    return sourceCache.get(name);
  };
  const fileExists = host.fileExists.bind(host);
  host.fileExists = (name) => name === virtualFile || fileExists(name);
  const program = ts.createProgram([virtualFile], options, host);
  return ts.getPreEmitDiagnostics(program).map((d) => {
    const message = ts.flattenDiagnosticMessageText(d.messageText, " ");
    if (!d.file || d.file.fileName !== virtualFile) return `typescript: ${message}`;
    const { line } = d.file.getLineAndCharacterOfPosition(d.start);
    return `${describe(docs[owner[line]])}: unknown or mistyped field: ${message}`;
  });
}

export async function checkSchemas(docs) {
  return [...(await validateWithModels(docs)), ...typeCheck(docs)];
}
