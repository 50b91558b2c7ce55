#!/usr/bin/env node
// Checks deploy/docker/Dockerfile without a Docker engine:
//  - every stage is named (FROM ... AS name);
//  - every COPY/ADD source from the context exists in the repository, is not
//    git-ignored (a fresh clone would lack it) and is not .dockerignored;
//  - every repository script a RUN calls exists and was copied in that stage
//    before the RUN (COPY keeps repo-relative paths under WORKDIR);
//  - the final stage runs as a numeric non-root USER, its ENTRYPOINT is
//    layercast-shard and it copies layercast beside it; it EXPOSEs the gRPC
//    and metrics ports, and LABELs the OCI title and version (CMakeLists.txt's
//    project VERSION);
//  - with --bin-dir, the runtime stage's apt-get install names the package
//    of every shared library the built binaries load (ldd + dpkg -S).
// With --image-inspect, it checks a built image's configuration (the output
// of `podman image inspect`) against the Dockerfile's final stage: user,
// entrypoint, command, exposed ports, labels (and, with --revision, the
// org.opencontainers.image.revision label the build was given) and a PATH
// that finds the binaries.
//   node dockerfile.mjs --repo ROOT [--bin-dir DIR] DOCKERFILE
//   node dockerfile.mjs --repo ROOT --image-inspect INSPECT.json [--revision SHA] DOCKERFILE
//   node dockerfile.mjs --print-build-stage DOCKERFILE   (COPY/RUN lines)
import fs from "node:fs";
import path from "node:path";
import { execFileSync, spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";

// Packages of bookworm-slim itself, and sanitizer runtimes of test builds.
const BASE_PACKAGES = new Set(["libc6", "libgcc-s1", "libstdc++6"]);
const IGNORED_PACKAGES = /^lib(asan|ubsan|tsan|lsan)\d*$/;
// deploy/k8s/base's containerPorts `grpc` and `metrics` (the shard's
// listen and metrics_listen there).
const EXPOSED_PORTS = ["7070", "9090"];
// OCI annotations the Dockerfile must LABEL. The revision (the commit) is
// given at build time: --label org.opencontainers.image.revision=SHA.
const REQUIRED_LABELS = ["org.opencontainers.image.title", "org.opencontainers.image.version"];
const REVISION_LABEL = "org.opencontainers.image.revision";
// Where the final stage copies the binaries: the image's PATH must hold it.
const BIN_DIR_IN_IMAGE = "/usr/local/bin";

// Instructions with line continuations joined and comments dropped.
function instructions(text) {
  const out = [];
  let current = "";
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!current && (line.startsWith("#") || !line)) continue;
    if (line.startsWith("#")) continue; // comment inside a continued RUN
    current += (current ? " " : "") + line.replace(/\\$/, "").trim();
    if (!line.endsWith("\\")) {
      const [op, ...rest] = current.split(/\s+/);
      out.push({ op: op.toUpperCase(), args: rest.join(" ") });
      current = "";
    }
  }
  return out;
}

// LABEL k=v k2="v 2" ...: the pairs, quotes removed.
function labels(args) {
  const out = {};
  for (const [, key, raw] of args.matchAll(/([\w.-]+)=("(?:[^"\\]|\\.)*"|\S+)/g)) {
    out[key] = raw.startsWith('"') ? JSON.parse(raw) : raw;
  }
  return out;
}

// CMakeLists.txt's project(... VERSION x.y.z ...).
function projectVersion(repoRoot) {
  const cmake = fs.readFileSync(path.join(repoRoot, "CMakeLists.txt"), "utf8");
  return /project\(\s*\w+\s+VERSION\s+([\d.]+)/.exec(cmake)?.[1];
}

function gitIgnored(repoRoot, rel) {
  try {
    execFileSync("git", ["-C", repoRoot, "check-ignore", "-q", rel], { stdio: "ignore" });
    return true; // exit 0: ignored
  } catch {
    return false;
  }
}

function dockerIgnored(patterns, rel) {
  return patterns.some((p) => {
    const re = new RegExp("^" + p.replace(/^\*\*\//, "(?:.*/)?").replace(/\*/g, "[^/]*") + "(?:/|$)");
    return re.test(rel);
  });
}

// Debian packages of the shared libraries an executable loads. One dpkg -S
// for all of them (it is slow); remembered per binary.
const packageCache = new Map();
function runtimePackages(binary) {
  if (packageCache.has(binary)) return packageCache.get(binary);
  const libs = new Set();
  for (const line of execFileSync("ldd", [binary], { encoding: "utf8" }).split("\n")) {
    const lib = /=>\s+(\/\S+)/.exec(line)?.[1];
    // dpkg knows a library under its /usr/lib path or its /lib (merged-usr) one.
    if (lib) libs.add(lib).add(fs.realpathSync(lib)).add(lib.replace(/^\/usr\/lib\//, "/lib/"));
  }
  const owners = spawnSync("dpkg", ["-S", ...libs], { encoding: "utf8" }).stdout;
  const packages = new Set(owners.split("\n").map((l) => /^([a-z0-9][a-z0-9.+-]*)(?::\w+)?: \//.exec(l)?.[1])
    .filter(Boolean));
  packageCache.set(binary, packages);
  return packages;
}

export function checkDockerfile(file, { repoRoot, binDir }) {
  const errors = [];
  const ignoreFile = `${file}.dockerignore`;
  const ignores = fs.existsSync(ignoreFile)
    ? fs.readFileSync(ignoreFile, "utf8").split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"))
    : [];
  const stages = [];
  for (const { op, args } of instructions(fs.readFileSync(file, "utf8"))) {
    if (op === "FROM") {
      const m = /^(\S+)(?:\s+AS\s+(\S+))?$/i.exec(args.replace(/--platform=\S+\s+/, ""));
      if (!m?.[2]) errors.push(`FROM ${args}: stage has no name (FROM image AS name)`);
      stages.push({ name: m?.[2] ?? "?", image: m?.[1], copied: [], user: null, entrypoint: null, runs: [],
        exposed: [], labels: {} });
      continue;
    }
    const stage = stages.at(-1);
    if (!stage) {
      if (op !== "ARG") errors.push(`${op} before the first FROM`);
      continue;
    }
    if (op === "COPY" || op === "ADD") {
      const words = args.split(/\s+/);
      const fromStage = words.some((w) => w.startsWith("--from="));
      const paths = words.filter((w) => !w.startsWith("--"));
      const sources = paths.slice(0, -1);
      if (fromStage) {
        stage.copiedFromStages = [...(stage.copiedFromStages ?? []), ...sources];
        continue;
      }
      for (const source of sources) {
        const rel = path.posix.normalize(source).replace(/\/$/, "");
        if (!fs.existsSync(path.join(repoRoot, rel))) errors.push(`${op} ${source}: no such file in the repository`);
        else if (gitIgnored(repoRoot, rel)) errors.push(`${op} ${source}: git-ignored, absent from a fresh clone`);
        else if (dockerIgnored(ignores, rel)) errors.push(`${op} ${source}: excluded by ${path.basename(ignoreFile)}`);
        stage.copied.push(rel);
      }
    } else if (op === "RUN") {
      // Words that name a file of this repository: scripts and the like.
      for (const word of args.split(/[\s;&|()]+/)) {
        const rel = word.replace(/^\.\//, "");
        if (!/^(scripts|deploy|tests|tools)\/\S+$/.test(rel) && !/^\S+\.(sh|py)$/.test(rel)) continue;
        if (!fs.existsSync(path.join(repoRoot, rel))) {
          errors.push(`RUN ${word}: no such file in the repository`);
        } else if (!stage.copied.some((c) => rel === c || rel.startsWith(c + "/"))) {
          errors.push(`RUN ${word}: not copied into stage ${stage.name} before this RUN`);
        }
      }
      stage.runs.push(args);
    } else if (op === "USER") {
      stage.user = args;
    } else if (op === "ENTRYPOINT") {
      try {
        stage.entrypoint = JSON.parse(args);
      } catch {
        errors.push(`ENTRYPOINT ${args}: use the exec form ["..."] so the server is PID 1 and gets SIGTERM`);
      }
    } else if (op === "EXPOSE") {
      stage.exposed.push(...args.split(/\s+/).map((p) => p.replace(/\/tcp$/, "")));
    } else if (op === "LABEL") {
      Object.assign(stage.labels, labels(args));
    }
  }

  const final = stages.at(-1);
  if (!final) return [...errors, "no FROM"];
  if (stages.length < 2) errors.push("not multi-stage: build and runtime must be separate stages");
  const [uid] = (final.user ?? "").split(":");
  if (!/^\d+$/.test(uid) || Number(uid) === 0) {
    errors.push(`final stage ${final.name}: USER '${final.user ?? ""}' must be a numeric non-root uid ` +
      "(runAsNonRoot can only verify numbers)");
  }
  const entry = path.posix.basename(final.entrypoint?.[0] ?? "");
  if (entry !== "layercast-shard") {
    errors.push(`final stage ${final.name}: ENTRYPOINT must run layercast-shard, not '${final.entrypoint?.[0]}'`);
  }
  for (const binary of ["layercast-shard", "layercast"]) {
    if (!(final.copiedFromStages ?? []).some((s) => path.posix.basename(s) === binary)) {
      errors.push(`final stage ${final.name}: does not copy ${binary} from the build stage`);
    }
  }
  for (const port of EXPOSED_PORTS) {
    if (!final.exposed.includes(port)) {
      errors.push(`final stage ${final.name}: does not EXPOSE ${port} (deploy/k8s/base's containerPorts are ` +
        `${EXPOSED_PORTS.join(" and ")})`);
    }
  }
  for (const label of REQUIRED_LABELS) {
    if (!final.labels[label]) errors.push(`final stage ${final.name}: no LABEL ${label}`);
  }
  const version = projectVersion(repoRoot);
  const labelled = final.labels["org.opencontainers.image.version"];
  if (labelled && labelled !== version) {
    errors.push(`final stage ${final.name}: LABEL org.opencontainers.image.version="${labelled}", but ` +
      `CMakeLists.txt's project VERSION is ${version}`);
  }

  if (binDir) {
    const installed = new Set(final.runs.flatMap((r) =>
      /apt-get install/.test(r) ? r.split(/\s+/).filter((w) => /^[a-z0-9][a-z0-9.+-]+$/.test(w)) : []));
    for (const binary of ["layercast-shard", "layercast"]) {
      for (const pkg of runtimePackages(path.join(binDir, binary))) {
        if (!BASE_PACKAGES.has(pkg) && !IGNORED_PACKAGES.test(pkg) && !installed.has(pkg)) {
          errors.push(`final stage ${final.name}: ${binary} loads a library from ${pkg}, which it does not install`);
        }
      }
    }
  }
  return errors;
}

// What the final stage declares about the image: USER, ENTRYPOINT, CMD,
// EXPOSE (ports without /tcp) and LABELs; the last of each, as Docker takes.
export function finalStageConfig(file) {
  let config = null;
  for (const { op, args } of instructions(fs.readFileSync(file, "utf8"))) {
    if (op === "FROM") config = { user: null, entrypoint: null, cmd: null, exposed: [], labels: {} };
    else if (!config) continue;
    else if (op === "USER") config.user = args;
    else if (op === "ENTRYPOINT" || op === "CMD") {
      let value;
      try {
        value = JSON.parse(args);
      } catch {
        value = ["/bin/sh", "-c", args];
      }
      config[op === "CMD" ? "cmd" : "entrypoint"] = value;
      if (op === "ENTRYPOINT") config.cmd = null; // Docker: a new ENTRYPOINT clears CMD
    } else if (op === "EXPOSE") config.exposed.push(...args.split(/\s+/).map((p) => p.replace(/\/tcp$/, "")));
    else if (op === "LABEL") Object.assign(config.labels, labels(args));
  }
  return config;
}

const sameJson = (a, b) => JSON.stringify(a ?? null) === JSON.stringify(b ?? null);

// A built image's configuration against the Dockerfile's final stage.
// `inspect`: one element of `podman image inspect`'s (or docker's) array.
// `revision`: the commit the image was built from, which its
// org.opencontainers.image.revision label must name; undefined: not checked.
export function checkImageConfig(file, inspect, { revision } = {}) {
  const errors = [];
  const want = finalStageConfig(file);
  const got = inspect?.Config ?? {};
  const image = inspect?.RepoTags?.[0] ?? inspect?.Id ?? "the image";
  if (!want) return [`${file}: no FROM`];
  if ((got.User ?? "") !== (want.user ?? "")) {
    errors.push(`${image}: user '${got.User ?? ""}', but the Dockerfile's USER is '${want.user ?? ""}'`);
  }
  const [uid] = (got.User ?? "").split(":");
  if (!/^\d+$/.test(uid) || Number(uid) === 0) {
    errors.push(`${image}: user '${got.User ?? ""}' must be a numeric non-root uid`);
  }
  if (!sameJson(got.Entrypoint, want.entrypoint)) {
    errors.push(`${image}: entrypoint ${JSON.stringify(got.Entrypoint)}, but the Dockerfile's is ` +
      JSON.stringify(want.entrypoint));
  }
  if (path.posix.basename(got.Entrypoint?.[0] ?? "") !== "layercast-shard") {
    errors.push(`${image}: entrypoint must run layercast-shard, not ${JSON.stringify(got.Entrypoint)}`);
  }
  if (!sameJson(got.Cmd, want.cmd)) {
    errors.push(`${image}: command ${JSON.stringify(got.Cmd)}, but the Dockerfile's CMD is ${JSON.stringify(want.cmd)}`);
  }
  const ports = Object.keys(got.ExposedPorts ?? {}).sort();
  const wantPorts = want.exposed.map((p) => (p.includes("/") ? p : `${p}/tcp`)).sort();
  if (!sameJson(ports, wantPorts)) {
    errors.push(`${image}: exposes [${ports.join(", ")}], but the Dockerfile EXPOSEs [${wantPorts.join(", ")}]`);
  }
  for (const port of EXPOSED_PORTS) {
    if (!ports.includes(`${port}/tcp`)) errors.push(`${image}: does not expose ${port}/tcp`);
  }
  const expectedLabels = { ...want.labels, ...(revision === undefined ? {} : { [REVISION_LABEL]: revision }) };
  for (const [key, expected] of Object.entries(expectedLabels)) {
    if (!(key in (got.Labels ?? {}))) errors.push(`${image}: no label ${key}`);
    else if (got.Labels[key] !== expected) {
      errors.push(`${image}: label ${key}="${got.Labels[key]}", expected "${expected}"`);
    }
  }
  const pathEnv = (got.Env ?? []).find((e) => e.startsWith("PATH="))?.slice(5) ?? "";
  if (!pathEnv.split(":").includes(BIN_DIR_IN_IMAGE)) {
    errors.push(`${image}: PATH '${pathEnv}' does not hold ${BIN_DIR_IN_IMAGE}, where the binaries are`);
  }
  return errors;
}

// The first stage's context paths and RUN commands, for run_deploy_checks.sh
// to repeat the configure step outside Docker on exactly that context.
export function buildStage(file) {
  const stage = { copied: [], runs: [] };
  let seen = 0;
  for (const { op, args } of instructions(fs.readFileSync(file, "utf8"))) {
    if (op === "FROM" && ++seen > 1) break;
    if ((op === "COPY" || op === "ADD") && !/--from=/.test(args)) {
      stage.copied.push(...args.split(/\s+/).filter((w) => !w.startsWith("--")).slice(0, -1));
    }
    if (op === "RUN") stage.runs.push(args);
  }
  return stage;
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const argv = process.argv.slice(2);
  let repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
  let binDir;
  let file;
  let printBuildStage = false;
  let imageInspect;
  let revision;
  for (let i = 0; i < argv.length; ++i) {
    if (argv[i] === "--repo") repoRoot = argv[++i];
    else if (argv[i] === "--bin-dir") binDir = argv[++i];
    else if (argv[i] === "--print-build-stage") printBuildStage = true;
    else if (argv[i] === "--image-inspect") imageInspect = argv[++i];
    else if (argv[i] === "--revision") revision = argv[++i];
    else file = argv[i];
  }
  if (imageInspect) {
    const inspected = JSON.parse(fs.readFileSync(imageInspect, "utf8"));
    const image = Array.isArray(inspected) ? inspected[0] : inspected;
    const errors = checkImageConfig(file, image, { revision });
    for (const e of errors) console.log(`  FAIL ${e}`);
    if (!errors.length) {
      const c = image.Config;
      console.log(`${image.RepoTags?.[0] ?? image.Id}: ok: user ${c.User}, entrypoint ${JSON.stringify(c.Entrypoint)}, ` +
        `ports ${Object.keys(c.ExposedPorts ?? {}).join(" ")}, ${Object.keys(c.Labels ?? {}).length} labels ` +
        "as the Dockerfile says");
    }
    process.exit(errors.length ? 1 : 0);
  }
  if (printBuildStage) {
    // "COPY path" and "RUN command" lines, one per instruction.
    const stage = buildStage(file);
    for (const c of stage.copied) console.log(`COPY ${c}`);
    for (const r of stage.runs) console.log(`RUN ${r}`);
    process.exit(0);
  }
  const errors = checkDockerfile(file, { repoRoot, binDir });
  for (const e of errors) console.log(`  FAIL ${e}`);
  if (!errors.length) {
    console.log(`${file}: ok: stages named, sources and scripts exist, non-root USER, ` +
      `ENTRYPOINT layercast-shard${binDir ? ", runtime libraries complete" : ""}`);
  }
  process.exit(errors.length ? 1 : 0);
}
