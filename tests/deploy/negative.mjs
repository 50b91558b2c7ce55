#!/usr/bin/env node
// Negative tests for the deploy validators: each case breaks one thing and
// must fail with a message naming that thing (so a case cannot pass because
// of some unrelated failure). The unbroken input must pass first.
//   node tests/deploy/negative.mjs RENDERED_OVERLAY.yaml [BIN_DIR]
// Prints "ok"/"not ok" per case and "negative: N passed, M failed".
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { execFileSync, spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { parseDocs, validateDocs } from "../../deploy/validate/validate.mjs";
import { checkDockerfile, checkImageConfig, finalStageConfig } from "../../deploy/validate/dockerfile.mjs";

const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const [renderedFile, binDir] = process.argv.slice(2);
const rendered = parseDocs(fs.readFileSync(renderedFile, "utf8"));
const shardBinary = binDir ? path.join(binDir, "layercast-shard") : undefined;

const find = (docs, kind) => docs.find((d) => d.kind === kind);
const shard = (docs) => find(docs, "StatefulSet").spec.template.spec.containers[0];
const worker = (docs) => find(docs, "Job").spec.template.spec.containers[0];
const configMap = (docs) => find(docs, "ConfigMap");
const policy = (docs) => find(docs, "NetworkPolicy");
const podSpec = (docs) => find(docs, "StatefulSet").spec.template.spec;
const volume = (docs, name) => podSpec(docs).volumes.find((v) => v.name === name);
const editConfig = (docs, edit) => {
  const cm = configMap(docs);
  const config = JSON.parse(cm.data["config.json"]);
  edit(config);
  cm.data["config.json"] = JSON.stringify(config);
};
const rename = (obj, from, to) => {
  obj[to] = obj[from];
  delete obj[from];
};

// [name, expected message (regex), mutation of the rendered example overlay]
const mutations = [
  ["misspelled container field readinessProbes", /'"readinessProbes"' does not exist/,
    (d) => rename(shard(d), "readinessProbe", "readinessProbes")],
  ["misspelled pod field terminationGracePeriodSecond", /'"terminationGracePeriodSecond"' does not exist/,
    (d) => rename(find(d, "StatefulSet").spec.template.spec, "terminationGracePeriodSeconds",
      "terminationGracePeriodSecond")],
  ["misspelled PodMonitor field podMetricEndpoints", /'"podMetricEndpoints"' does not exist/,
    (d) => rename(find(d, "PodMonitor").spec, "podMetricsEndpoints", "podMetricEndpoints")],
  ["replicas of the wrong type", /\/spec\/replicas must be integer/,
    (d) => { find(d, "StatefulSet").spec.replicas = "8"; }],
  ["unknown apiVersion", /no schema for apiVersion policy\/v1beta2/,
    (d) => { find(d, "PodDisruptionBudget").apiVersion = "policy/v1beta2"; }],
  ["ordinals.start set", /spec\.ordinals\.start is 1/,
    (d) => { find(d, "StatefulSet").spec.ordinals = { start: 1 }; }],
  ["shard index not from the pod-index label", /--shard-index must be/,
    (d) => { shard(d).env[0].valueFrom.fieldRef.fieldPath = "metadata.name"; }],
  ["replicas differ from num-shards", /spec\.replicas is 3 but ConfigMap/,
    (d) => { find(d, "StatefulSet").spec.replicas = 3; }],
  ["Service not headless", /must be headless/,
    (d) => { delete find(d, "Service").spec.clusterIP; }],
  ["Service selects no shard", /Service\/layercast: spec\.selector selects no pod/,
    (d) => { find(d, "Service").spec.selector["app.kubernetes.io/component"] = "shards"; }],
  ["Service also selects the worker Job", /also selects the pods of Job/,
    (d) => { delete find(d, "Service").spec.selector["app.kubernetes.io/component"]; }],
  ["readiness probe on a port the container lacks", /readinessProbe\.grpc\.port 7072 is not a container port/,
    (d) => { shard(d).readinessProbe.grpc.port = 7072; }],
  ["liveness probe on a named port", /livenessProbe\.grpc\.port must be numeric/,
    (d) => { shard(d).livenessProbe.grpc.port = "grpc"; }],
  ["readiness probe on the process-wide service", /readinessProbe\.grpc\.service must be/,
    (d) => { delete shard(d).readinessProbe.grpc.service; }],
  ["PodMonitor port name that no container has", /port 'prometheus' names no container port/,
    (d) => { find(d, "PodMonitor").spec.podMetricsEndpoints[0].port = "prometheus"; }],
  ["PDB maxUnavailable 2", /maxUnavailable must be 1/,
    (d) => { find(d, "PodDisruptionBudget").spec.maxUnavailable = 2; }],
  ["checkpoint_dir on an emptyDir", /checkpoint_dir \/tmp\/checkpoints is on volume tmp, which is not a volumeClaimTemplate/,
    (d) => editConfig(d, (c) => { c.checkpoint_dir = "/tmp/checkpoints"; })],
  ["checkpoint_dir on no volume", /checkpoint_dir \/var\/checkpoints is under no volume mounted/,
    (d) => editConfig(d, (c) => { c.checkpoint_dir = "/var/checkpoints"; })],
  ["checkpoint volume mounted read-only", /checkpoint_dir \/var\/lib\/layercast\/checkpoints is mounted read-only/,
    (d) => { shard(d).volumeMounts.find((m) => m.name === "checkpoints").readOnly = true; }],
  ["grace period not above the drain timeout", /terminationGracePeriodSeconds 20 must be at least/,
    (d) => { find(d, "StatefulSet").spec.template.spec.terminationGracePeriodSeconds = 20; }],
  ["grace period with no time to write the checkpoint", /terminationGracePeriodSeconds 40 must be at least drain_timeout_seconds 20 \+ 5 \+ 30 to write the checkpoint/,
    (d) => { find(d, "StatefulSet").spec.template.spec.terminationGracePeriodSeconds = 40; }],
  ["drain timeout in the config above the grace period", /drain_timeout_seconds 40/,
    (d) => editConfig(d, (c) => { c.drain_timeout_seconds = 40; })],
  ["memory request below the limit", /must equal memory limit/,
    (d) => { shard(d).resources.requests.memory = "4Gi"; }],
  ["memory limit without the headroom", /below memory_budget 4GiB \+ headroom 512Mi/,
    (d) => { shard(d).resources.requests.memory = shard(d).resources.limits.memory = "4Gi"; }],
  ["server listening on loopback only", /listen on all interfaces/,
    (d) => editConfig(d, (c) => { c.listen = "127.0.0.1:7070"; })],
  ["metrics port other than the container port", /metrics_listen port 9091 is not container port/,
    (d) => editConfig(d, (c) => { c.metrics_listen = "0.0.0.0:9091"; })],
  ["misspelled field in the server's JSON config", /unknown field 'memory_budgets'/,
    (d) => editConfig(d, (c) => rename(c, "memory_budget", "memory_budgets"))],
  ["shard count inside the shared JSON config", /num_shards does not belong/,
    (d) => editConfig(d, (c) => { c.num_shards = 8; })],
  ["worker pattern on the wrong port", /--shards-pattern 'layercast-\{i\}\.layercast:7071'/,
    (d) => { worker(d).args[1] = "--shards-pattern=layercast-{i}.layercast:7071"; }],
  ["worker shard count not from the ConfigMap", /--num-shards 4 must come from/,
    (d) => { worker(d).args[2] = "--num-shards=4"; }],
  ["ConfigMap reference outside the render", /refers to ConfigMap layercast-config,/,
    (d) => { shard(d).env[1].valueFrom.configMapKeyRef.name = "layercast-config"; }],
  ["misspelled NetworkPolicy field policyType", /'"policyType"' does not exist/,
    (d) => rename(policy(d).spec, "policyTypes", "policyType")],
  ["NetworkPolicy selects no shard", /NetworkPolicy\/layercast: spec\.podSelector selects no pod/,
    (d) => { policy(d).spec.podSelector.matchLabels["app.kubernetes.io/component"] = "shards"; }],
  ["NetworkPolicy port that no container has", /ingress rule 0 port 'grcp' is not a container port/,
    (d) => { policy(d).spec.ingress[0].ports[0].port = "grcp"; }],
  ["NetworkPolicy rule without from", /ingress rule 0 has no from: it admits every source/,
    (d) => { delete policy(d).spec.ingress[0].from; }],
  ["NetworkPolicy rule without ports", /ingress rule 1 has no ports: it admits every port/,
    (d) => { delete policy(d).spec.ingress[1].ports; }],
  ["worker pods without the label the policy admits",
    /Job\/layercast-worker: NetworkPolicy\/layercast admits its pods to no/,
    (d) => { delete find(d, "Job").spec.template.metadata.labels["layercast.io/role"]; }],
  ["metrics port closed to Prometheus", /no ingress rule admits Prometheus/,
    (d) => { policy(d).spec.ingress.pop(); }],
  ["TLS with probes on the TLS port", /serves TLS on listen, which native gRPC probes cannot speak/,
    (d) => editConfig(d, (c) => { delete c.health_listen; })],
  ["probes not on the health port", /readinessProbe\.grpc\.port 7070 is not the health_listen port 7071/,
    (d) => { shard(d).readinessProbe.grpc.port = 7070; }],
  ["token Secret others can read", /gives \/etc\/layercast-admin\/token mode 0644/,
    (d) => { volume(d, "admin-token").secret.defaultMode = 0o644; }],
  ["Secret files without fsGroup", /set the pod's securityContext\.fsGroup/,
    (d) => { delete podSpec(d).securityContext.fsGroup; }],
  ["private key not from a Secret",
    /tls_key_file \/etc\/layercast\/config\.json must come from a Secret volume/,
    (d) => editConfig(d, (c) => { c.tls_key_file = "/etc/layercast/config.json"; })],
  ["worker without --tls-ca-file against TLS shards", /the shards serve TLS; pass --tls-ca-file/,
    (d) => { worker(d).args = worker(d).args.filter((a) => !a.startsWith("--tls-ca-file")); }],
  ["unpinned image", /image 'layercast' has no pinned tag/,
    (d) => { shard(d).image = "layercast"; }],
];

// The relay overlay, rendered here: its own cases, on its own control.
const relayRendered = parseDocs(execFileSync("kubectl",
  ["kustomize", path.join(repoRoot, "deploy/k8s/overlays/relay")], { encoding: "utf8" }));
const named = (docs, kind, name) => docs.find((d) => d.kind === kind && d.metadata.name === name);
const relay = (docs) => named(docs, "Deployment", "layercast-relay").spec.template.spec.containers[0];
const relayPolicy = (docs) => named(docs, "NetworkPolicy", "layercast-relay");
const relayMutations = [
  ["relay listening for 3 shards of 4", /--listen names 3 addresses but ConfigMap .* says 4 shards/,
    (d) => { const a = relay(d).args; a[a.findIndex((x) => x.startsWith("--listen="))] = "--listen=0.0.0.0:7100,0.0.0.0:7101,0.0.0.0:7102"; }],
  ["relay with a gRPC probe", /readinessProbe is a gRPC probe, but a relay serves no grpc\.health\.v1/,
    (d) => { relay(d).readinessProbe = { grpc: { port: 7100 } }; }],
  ["relay metrics on an unnamed port", /--metrics-listen 0\.0\.0\.0:9101 must be/,
    (d) => { const a = relay(d).args; a[a.findIndex((x) => x.startsWith("--metrics-listen="))] = "--metrics-listen=0.0.0.0:9101"; }],
  ["relay Service without ClientIP affinity", /sessionAffinity must be ClientIP/,
    (d) => { delete named(d, "Service", "layercast-relay").spec.sessionAffinity; }],
  ["relay Service missing a shard's port", /exposes no port for the relay's --listen port 7103/,
    (d) => { named(d, "Service", "layercast-relay").spec.ports.pop(); }],
  ["relay without a PDB", /no PodDisruptionBudget selects the relay's pods/,
    (d) => d.splice(d.indexOf(named(d, "PodDisruptionBudget", "layercast-relay")), 1)],
  ["relay PodMonitor on another port", /no podMetricsEndpoints port names the relay's metrics port/,
    (d) => { named(d, "PodMonitor", "layercast-relay").spec.podMetricsEndpoints[0].port = "relay-0"; }],
  ["relay egress without the shards", /lets the relay reach no shard of StatefulSet\/layercast/,
    (d) => { relayPolicy(d).spec.egress.shift(); }],
  ["relay egress without DNS", /allows no DNS/, (d) => { relayPolicy(d).spec.egress.pop(); }],
  ["relay closed to Prometheus", /NetworkPolicy\/layercast-relay: no ingress rule admits Prometheus/,
    (d) => { relayPolicy(d).spec.ingress.pop(); }],
  ["relay pods the shards do not admit", /Deployment\/layercast-relay: NetworkPolicy\/layercast admits its pods to no/,
    (d) => { delete named(d, "Deployment", "layercast-relay").spec.template.metadata.labels["layercast.io/role"]; }],
  ["relay of mutual-TLS shards without a client CA", /would serve readers without one, which it refuses: give --serve-tls-client-ca-file/,
    (d) => { relay(d).args.push("--tls-ca-file=/tls/ca.crt", "--tls-cert-file=/tls/tls.crt", "--tls-key-file=/tls/tls.key", "--serve-tls-cert-file=/tls/tls.crt", "--serve-tls-key-file=/tls/tls.key"); }],
];

// Overlays a user might write; kubectl kustomize renders them for real.
const fixtures = [
  ["fixture misspelled-patch", /'"terminationGracePeriodSecnds"' does not exist/],
  ["fixture ordinals-start", /spec\.ordinals\.start is 1/],
  ["fixture forgot-shard-count", /replicas is 4 but .* says 8 shards/],
];

// [name, expected message, edit of the Dockerfile text]
const dockerfile = fs.readFileSync(path.join(repoRoot, "deploy/docker/Dockerfile"), "utf8");
const dockerMutations = [
  ["COPY of a missing path", /COPY kernels: no such file/, (t) => t.replace("COPY core core", "COPY kernels kernels")],
  ["COPY of a git-ignored path", /COPY build: git-ignored/, (t) => t.replace("COPY core core", "COPY build build")],
  ["RUN of a script never copied in", /RUN scripts\/install-deps.sh: not copied/,
    (t) => t.replace(/^COPY scripts\/install-deps.sh.*$/m, "")],
  ["RUN of a missing script", /RUN scripts\/setup.sh: no such file/,
    (t) => t.replace("RUN scripts/install-deps.sh", "RUN scripts/setup.sh")],
  ["unnamed stage", /stage has no name/, (t) => t.replace("FROM debian:bookworm AS build", "FROM debian:bookworm")],
  ["final USER by name", /USER 'layercast' must be a numeric non-root uid/,
    (t) => t.replace("USER 10001:10001", "USER layercast")],
  ["final USER root", /USER '0' must be a numeric non-root uid/, (t) => t.replace("USER 10001:10001", "USER 0")],
  ["shell-form ENTRYPOINT", /use the exec form/,
    (t) => t.replace('ENTRYPOINT ["layercast-shard"]', "ENTRYPOINT layercast-shard")],
  ["ENTRYPOINT of the worker tool", /ENTRYPOINT must run layercast-shard/,
    (t) => t.replace('ENTRYPOINT ["layercast-shard"]', 'ENTRYPOINT ["layercast"]')],
  ["layercast not copied beside the server", /does not copy layercast from/,
    (t) => t.replace(" /src/build/bin/layercast /usr/local/bin/", " /usr/local/bin/")],
  ["metrics port not exposed", /does not EXPOSE 9090/, (t) => t.replace("EXPOSE 7070 9090", "EXPOSE 7070")],
  ["version label not the project's", /image.version="9.9.9", but CMakeLists.txt's project VERSION is/,
    (t) => t.replace(/(org\.opencontainers\.image\.version=)"[^"]*"/, '$1"9.9.9"')],
  ["no title label", /no LABEL org.opencontainers.image.title/,
    (t) => t.replace(/org\.opencontainers\.image\.title="[^"]*"/, "")],
];

// A built image's configuration (podman image inspect), made from what the
// Dockerfile declares, then broken one field at a time.
const dockerfilePath = path.join(repoRoot, "deploy/docker/Dockerfile");
const declared = finalStageConfig(dockerfilePath);
const revision = "0123456789abcdef0123456789abcdef01234567";
const builtImage = () => ({
  RepoTags: ["localhost/layercast:test"],
  Config: {
    User: declared.user,
    Entrypoint: declared.entrypoint,
    Cmd: declared.cmd,
    ExposedPorts: Object.fromEntries(declared.exposed.map((p) => [`${p}/tcp`, {}])),
    Labels: { ...declared.labels, "org.opencontainers.image.revision": revision },
    Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
  },
});
const imageMutations = [
  ["image runs as root", /user '' must be a numeric non-root uid/, (c) => { delete c.User; }],
  ["image user by name", /user 'layercast', but the Dockerfile's USER is '10001:10001'/,
    (c) => { c.User = "layercast"; }],
  ["image entrypoint a shell", /entrypoint must run layercast-shard/, (c) => { c.Entrypoint = ["/bin/sh", "-c"]; }],
  ["image without the metrics port", /does not expose 9090\/tcp/, (c) => { delete c.ExposedPorts["9090/tcp"]; }],
  ["image without a label", /no label org.opencontainers.image.title/,
    (c) => { delete c.Labels["org.opencontainers.image.title"]; }],
  ["image built without the revision label", /no label org.opencontainers.image.revision/,
    (c) => { delete c.Labels["org.opencontainers.image.revision"]; }],
  ["image of another commit", /label org.opencontainers.image.revision="unknown", expected "0123/,
    (c) => { c.Labels["org.opencontainers.image.revision"] = "unknown"; }],
  ["image PATH without /usr/local/bin", /does not hold \/usr\/local\/bin/, (c) => { c.Env = ["PATH=/usr/bin:/bin"]; }],
];
if (binDir) {
  // The shard's own dry run sizes the model against the budget.
  mutations.push(["budget that cannot hold the model", /cannot hold the model \(layercast-shard --dry-run\): .*too small: shard 0 of 8 needs/,
    (d) => editConfig(d, (c) => { c.memory_budget = "64MiB"; })]);
}
mutations.push(["served file without its shapes", /annotation layercast\/model-shape must give/,
  (d) => editConfig(d, (c) => { delete c.synthetic; c.model = "/models/llama-70b"; })]);
if (binDir) {
  dockerMutations.push(["runtime stage missing a library", /loads a library from libprotobuf32/,
    (t) => t.replace("libprotobuf32 ", "")]);
}

let passed = 0;
let failed = 0;
function expectFailure(name, errors, expected) {
  const hit = errors.find((e) => expected.test(e));
  if (hit) {
    passed += 1;
    console.log(`ok - ${name}: ${hit}`);
  } else {
    failed += 1;
    console.log(`not ok - ${name}: expected ${expected}, got: ${errors.join(" | ") || "no failure"}`);
  }
}

// The controls: unbroken inputs pass, so a failure below is the mutation's.
const control = await validateDocs(rendered, { repoRoot, shardBinary });
const dockerControl = checkDockerfile(dockerfilePath, { repoRoot, binDir });
const imageControl = checkImageConfig(dockerfilePath, builtImage(), { revision });
if (control.length || dockerControl.length || imageControl.length) {
  console.log(`not ok - controls must pass first: ${[...control, ...dockerControl, ...imageControl].join(" | ")}`);
  process.exit(1);
}

for (const [name, expected, mutate] of mutations) {
  const docs = structuredClone(rendered);
  mutate(docs);
  expectFailure(name, await validateDocs(docs, { repoRoot, shardBinary }), expected);
}

const relayControl = await validateDocs(relayRendered, { repoRoot, shardBinary });
if (relayControl.length) {
  console.log(`not ok - the relay overlay must pass first: ${relayControl.join(" | ")}`);
  process.exit(1);
}
for (const [name, expected, mutate] of relayMutations) {
  const docs = structuredClone(relayRendered);
  mutate(docs);
  expectFailure(name, await validateDocs(docs, { repoRoot, shardBinary }), expected);
}

for (const [name, expected] of fixtures) {
  const dir = path.join(repoRoot, "tests/deploy/fixtures", name.replace("fixture ", ""));
  const yaml = execFileSync("kubectl", ["kustomize", dir], { encoding: "utf8" });
  expectFailure(name, await validateDocs(parseDocs(yaml), { repoRoot, shardBinary }), expected);
}

for (const [name, expected, mutate] of imageMutations) {
  const image = builtImage();
  mutate(image.Config);
  expectFailure(`built image: ${name}`, checkImageConfig(dockerfilePath, image, { revision }), expected);
}

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "layercast-dockerfile-"));
try {
  const ignore = fs.readFileSync(path.join(repoRoot, "deploy/docker/Dockerfile.dockerignore"));
  for (const [name, expected, edit] of dockerMutations) {
    const file = path.join(tmp, "Dockerfile");
    fs.writeFileSync(file, edit(dockerfile));
    fs.writeFileSync(`${file}.dockerignore`, ignore);
    expectFailure(`Dockerfile: ${name}`, checkDockerfile(file, { repoRoot, binDir }), expected);
  }

  // yamllint with the project's config must reject a broken file.
  const bad = path.join(tmp, "bad.yaml");
  fs.writeFileSync(bad, "kind: Service\nmetadata:\n  name: a\n  name: b\nspec:  \n   ports: []\n");
  const lint = spawnSync("yamllint", ["-c", path.join(repoRoot, "deploy/.yamllint"), bad], { encoding: "utf8" });
  expectFailure("yamllint: duplicate key, trailing space, bad indentation",
    lint.status !== 0 ? lint.stdout.split("\n").map((l) => l.trim()) : [], /duplication of key "name"/);
} finally {
  fs.rmSync(tmp, { recursive: true, force: true });
}

console.log(`negative: ${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
