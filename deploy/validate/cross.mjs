// Checks that span objects, or that need layercast's own knowledge: the things
// a schema cannot see but that break a shard set at run time.
import fs from "node:fs";
import path from "node:path";
import { spawnSync } from "node:child_process";
import { parseBudget, parseQuantity, formatBytes } from "./quantity.mjs";

const POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']";
const READINESS_SERVICE = "layercast.v1.ShardService";
const HEADROOM_ANNOTATION = "layercast/memory-headroom";
// The served model's shapes as a synthetic spec, for a set that serves a
// file (--model): what the shard's dry run sizes.
const MODEL_SHAPE_ANNOTATION = "layercast/model-shape";
const DEFAULT_GRACE_SECONDS = 30; // Kubernetes' default
const EXIT_MARGIN_SECONDS = 5; // time to exit after the drain ends
// Time to write the checkpoint on SIGTERM (checkpoint_dir set, and
// checkpoint_on_sigterm not false): a few GB to a network volume.
const CHECKPOINT_MARGIN_SECONDS = 30;

// Field names of layercast.v1.ShardConfig and their defaults, read from the
// proto so that they cannot drift (the proto writes each default once):
// proto3 JSON accepts each name as snake_case or lowerCamelCase.
export function shardConfigFields(repoRoot) {
  const proto = fs.readFileSync(path.join(repoRoot, "proto/layercast/v1/config.proto"), "utf8");
  const body = /message ShardConfig \{([\s\S]*?)\n\}/.exec(proto)[1];
  const fields = new Map(); // json key -> { name, type, defaultValue }
  // "[optional] TYPE NAME = N;" or "... = N [(help) = ..., (default_value) = D];"
  const declaration = /^\s*(?:optional\s+)?(\w+)\s+(\w+)\s*=\s*\d+\s*(?:;|\[([\s\S]*?)\];)/gm;
  for (const [, type, name, options] of body.matchAll(declaration)) {
    const camel = name.replace(/_([a-z])/g, (_, c) => c.toUpperCase());
    const found = /\(default_value\)\s*=\s*(\d+)/.exec(options ?? "");
    const field = { name, type, defaultValue: found ? Number(found[1]) : undefined };
    fields.set(name, field);
    fields.set(camel, field);
  }
  return fields;
}

const selects = (selector, labels) =>
  !!selector && Object.keys(selector).length > 0 &&
  Object.entries(selector).every(([k, v]) => labels?.[k] === v);

const id = (o) => `${o.kind}/${o.metadata?.name}`;

// The value of --NAME in args, in either "--NAME=V" or "--NAME V" form.
function flag(args, name) {
  for (let i = 0; i < args.length; ++i) {
    if (args[i] === `--${name}`) return args[i + 1];
    if (args[i].startsWith(`--${name}=`)) return args[i].slice(name.length + 3);
  }
  return undefined;
}

// "$(VAR)" -> the env entry of VAR, else undefined.
function envRef(container, value) {
  const m = /^\$\((\w+)\)$/.exec(value ?? "");
  return m ? (container.env ?? []).find((e) => e.name === m[1]) : undefined;
}

function splitHostPort(address) {
  const m = /^(.*):(\d+)$/.exec(address ?? "");
  return m ? { host: m[1], port: Number(m[2]) } : null;
}

// `shardBinary`: a layercast-shard to run --dry-run with, so that the memory
// check is the shard's own start-up arithmetic; skipped without one.
export function checkCrossObject(docs, { repoRoot, shardBinary }) {
  const errors = [];
  const fail = (obj, message) => errors.push(`${id(obj)}: ${message}`);
  const byKind = (kind) => docs.filter((d) => d.kind === kind);
  const configMaps = new Map(byKind("ConfigMap").map((c) => [c.metadata.name, c]));
  const ns = (o) => o.metadata?.namespace ?? "";

  for (const kind of ["StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "PodMonitor",
    "NetworkPolicy"]) {
    if (byKind(kind).length === 0) errors.push(`no ${kind} in the rendered manifests`);
  }

  // Every pod-owning object, to check that selectors pick only shard pods.
  const workloads = docs.filter((d) => d.spec?.template?.spec?.containers);
  // Relays (`layercast relay`) have objects of their own (Service, PDB,
  // PodMonitor, NetworkPolicy), checked by checkRelays, not as the shards'.
  const relays = workloads.filter((w) => relayContainer(w));
  const selectorOf = (o) => o.spec?.podSelector?.matchLabels ?? o.spec?.selector?.matchLabels ??
    (o.kind === "Service" ? o.spec?.selector : undefined);
  const forRelay = (o) => relays.some((r) => ns(r) === ns(o) &&
    selects(selectorOf(o), r.spec.template.metadata?.labels));
  const shardObjects = (kind) => byKind(kind).filter((o) => !forRelay(o));

  // Every ConfigMap a pod names must be in the render (names carry a hash).
  for (const w of workloads) {
    const pod = w.spec.template.spec;
    const refs = [
      ...(pod.volumes ?? []).filter((v) => v.configMap).map((v) => v.configMap.name),
      ...[...(pod.containers ?? []), ...(pod.initContainers ?? [])].flatMap((c) =>
        (c.env ?? []).map((e) => e.valueFrom?.configMapKeyRef?.name).filter(Boolean)),
    ];
    for (const name of refs) {
      if (!configMaps.has(name)) fail(w, `refers to ConfigMap ${name}, which is not in the render`);
    }
  }

  const shardFields = shardConfigFields(repoRoot);

  for (const sts of byKind("StatefulSet")) {
    const pod = sts.spec.template.spec;
    const podLabels = sts.spec.template.metadata?.labels ?? {};
    const replicas = sts.spec.replicas ?? 1;

    // Shard index = pod-index label, which starts at ordinals.start.
    const start = sts.spec.ordinals?.start ?? 0;
    if (start !== 0) {
      fail(sts, `spec.ordinals.start is ${start}: pod-index labels would run ${start}..` +
        `${start + replicas - 1} but shard indices must run 0..${replicas - 1}; remove it`);
    }
    if (!selects(sts.spec.selector?.matchLabels, podLabels)) {
      fail(sts, "spec.selector.matchLabels does not match the pod template's labels");
    }

    const shard = pod.containers.find((c) => (c.ports ?? []).some((p) => p.name === "grpc"));
    if (!shard) {
      fail(sts, "no container has a port named grpc");
      continue;
    }
    const args = shard.args ?? [];
    const portsByName = new Map((shard.ports ?? []).map((p) => [p.name, p.containerPort]));
    const containerPorts = new Set((shard.ports ?? []).map((p) => p.containerPort));

    // --shard-index from the downward API's pod-index label.
    const indexEnv = envRef(shard, flag(args, "shard-index"));
    if (indexEnv?.valueFrom?.fieldRef?.fieldPath !== POD_INDEX_FIELD) {
      fail(sts, `--shard-index must be $(VAR) with VAR from the downward API field ${POD_INDEX_FIELD}`);
    }

    // --num-shards from one ConfigMap key, equal to replicas.
    const countEnv = envRef(shard, flag(args, "num-shards"));
    const countRef = countEnv?.valueFrom?.configMapKeyRef;
    const countText = countRef ? configMaps.get(countRef.name)?.data?.[countRef.key] : undefined;
    if (countText === undefined) {
      fail(sts, "--num-shards must be $(VAR) with VAR from a ConfigMap key (the one shard count)");
    } else if (Number(countText) !== replicas) {
      fail(sts, `spec.replicas is ${replicas} but ConfigMap ${countRef.name} key ${countRef.key} ` +
        `says ${countText} shards (did the overlay include components/shard-count?)`);
    }

    // The server's effective config: the JSON file, then flags on top.
    const configPath = flag(args, "config");
    let config = {};
    const mount = (shard.volumeMounts ?? []).find((m) => configPath?.startsWith(m.mountPath + "/"));
    const volume = (pod.volumes ?? []).find((v) => v.name === mount?.name);
    const configMap = configMaps.get(volume?.configMap?.name);
    const fileName = configPath ? path.posix.basename(configPath) : undefined;
    if (!configMap || configMap.data?.[fileName] === undefined) {
      fail(sts, `--config ${configPath} is not a key of a ConfigMap mounted in the container`);
    } else {
      try {
        config = JSON.parse(configMap.data[fileName]);
      } catch (e) {
        fail(configMap, `${fileName} is not JSON: ${e.message}`);
      }
    }
    const effective = {};
    for (const [key, value] of Object.entries(config)) {
      const field = shardFields.get(key);
      if (!field) {
        fail(configMap, `${fileName}: unknown field '${key}' (not in layercast.v1.ShardConfig; ` +
          "the server refuses the file)");
        continue;
      }
      if (field.type === "string" && typeof value !== "string") {
        fail(configMap, `${fileName}: ${key} must be a string`);
      }
      if (/int/.test(field.type) && !/^\d+$/.test(String(value))) {
        fail(configMap, `${fileName}: ${key} must be a non-negative integer`);
      }
      if (field.name === "shard_index" || field.name === "num_shards") {
        fail(configMap, `${fileName}: ${key} does not belong in the shared config: the index comes ` +
          "from the pod, the count from the ConfigMap key behind --num-shards");
      }
      effective[field.name] = value;
    }
    for (const { name } of shardFields.values()) {
      const value = flag(args, name.replace(/_/g, "-"));
      if (value !== undefined) effective[name] = value;
    }

    // Listen on all interfaces, on the ports the pod declares.
    for (const [field, portName] of [["listen", "grpc"], ["metrics_listen", "metrics"]]) {
      const address = splitHostPort(effective[field]);
      if (!address) {
        fail(sts, `the server's ${field} must be set to 0.0.0.0:<port of '${portName}'>`);
        continue;
      }
      if (!["0.0.0.0", "[::]"].includes(address.host)) {
        fail(sts, `the server's ${field} is ${effective[field]}: listen on all interfaces ` +
          "(0.0.0.0), the kubelet and Prometheus dial the pod IP");
      }
      if (portsByName.get(portName) !== address.port) {
        fail(sts, `the server's ${field} port ${address.port} is not container port ` +
          `'${portName}' (${portsByName.get(portName)})`);
      }
    }
    if (!effective.model === !effective.synthetic) {
      fail(sts, "the server's config must set exactly one of model and synthetic");
    }

    // Native gRPC probes speak plaintext: with TLS on `listen` they must go
    // to the plaintext health-only port (health_listen), which then must be
    // a container port named health on all interfaces.
    const tls = !!effective.tls_cert_file;
    let probePort = portsByName.get("grpc");
    let probePortName = "the gRPC port";
    if (effective.health_listen) {
      const address = splitHostPort(effective.health_listen);
      if (!address || !["0.0.0.0", "[::]"].includes(address.host)) {
        fail(sts, `the server's health_listen is ${effective.health_listen}: listen on all ` +
          "interfaces (0.0.0.0), the kubelet dials the pod IP");
      } else if (portsByName.get("health") !== address.port) {
        fail(sts, `the server's health_listen port ${address.port} is not container port ` +
          `'health' (${portsByName.get("health")})`);
      }
      probePort = address?.port;
      probePortName = "the health_listen port";
    } else if (tls) {
      fail(sts, "the server serves TLS on listen, which native gRPC probes cannot speak: set " +
        "health_listen to 0.0.0.0:<port> (a container port named health) and probe that port");
    }

    // Native gRPC probes: numeric container ports; liveness on service "",
    // readiness on the ShardService (NOT_SERVING until loaded and when draining).
    for (const [probeName, service] of [["livenessProbe", ""], ["readinessProbe", READINESS_SERVICE]]) {
      const grpc = shard[probeName]?.grpc;
      if (!grpc) {
        fail(sts, `${probeName} must be a native gRPC probe`);
        continue;
      }
      if (typeof grpc.port !== "number") {
        fail(sts, `${probeName}.grpc.port must be numeric, not '${grpc.port}'`);
      } else if (!containerPorts.has(grpc.port)) {
        fail(sts, `${probeName}.grpc.port ${grpc.port} is not a container port`);
      } else if (grpc.port !== probePort) {
        fail(sts, `${probeName}.grpc.port ${grpc.port} is not ${probePortName} ${probePort}`);
      }
      if ((grpc.service ?? "") !== service) {
        fail(sts, `${probeName}.grpc.service must be '${service}', not '${grpc.service ?? ""}'`);
      }
    }
    for (const c of pod.containers) {
      for (const probeName of ["livenessProbe", "readinessProbe", "startupProbe"]) {
        const port = c[probeName]?.httpGet?.port ?? c[probeName]?.tcpSocket?.port;
        if (port !== undefined && !(c.ports ?? []).some((p) => p.containerPort === port || p.name === port)) {
          fail(sts, `container ${c.name} ${probeName} port ${port} is not a container port`);
        }
      }
    }

    // SIGKILL must not cut the drain short.
    const drain = Number(effective.drain_timeout_seconds ||
                         shardFields.get("drain_timeout_seconds").defaultValue);
    const grace = pod.terminationGracePeriodSeconds ?? DEFAULT_GRACE_SECONDS;
    const checkpointsOnExit = Boolean(effective.checkpoint_dir) &&
      String(effective.checkpoint_on_sigterm ?? "true") !== "false";
    const writeMargin = checkpointsOnExit ? CHECKPOINT_MARGIN_SECONDS : 0;
    if (grace < drain + EXIT_MARGIN_SECONDS + writeMargin) {
      fail(sts, `terminationGracePeriodSeconds ${grace} must be at least drain_timeout_seconds ` +
        `${drain} + ${EXIT_MARGIN_SECONDS}` +
        (writeMargin ? ` + ${writeMargin} to write the checkpoint on SIGTERM` : ""));
    }

    // Memory: request = limit >= budget + stated headroom.
    const request = shard.resources?.requests?.memory;
    const limit = shard.resources?.limits?.memory;
    if (!request || !limit || parseQuantity(request) !== parseQuantity(limit)) {
      fail(sts, `memory request (${request}) must equal memory limit (${limit})`);
    }
    const headroom = sts.metadata?.annotations?.[HEADROOM_ANNOTATION];
    if (!effective.memory_budget) {
      fail(sts, "the server's memory_budget must be set: the container has a memory limit");
    } else if (!headroom) {
      fail(sts, `annotation ${HEADROOM_ANNOTATION} must state the memory above memory_budget`);
    } else if (limit) {
      const need = parseBudget(effective.memory_budget) + parseQuantity(headroom);
      if (parseQuantity(limit) < need) {
        fail(sts, `memory limit ${limit} is below memory_budget ${effective.memory_budget} + ` +
          `headroom ${headroom} = ${formatBytes(need)}`);
      }
    }

    // The budget must hold the model: the shard's own dry run says so, with
    // the arithmetic of its start-up check (headers only, no data).
    const shape = effective.synthetic || sts.metadata?.annotations?.[MODEL_SHAPE_ANNOTATION];
    if (effective.model && !sts.metadata?.annotations?.[MODEL_SHAPE_ANNOTATION]) {
      fail(sts, `annotation ${MODEL_SHAPE_ANNOTATION} must give the shapes of the model at ` +
        `${effective.model} as a synthetic spec (e.g. llama:layers=80,hidden=8192,ffn=28672,` +
        "vocab=128256), so that its memory can be checked before it is deployed");
    } else if (shardBinary && shape && effective.memory_budget && countText) {
      const dryRun = ["--dry-run", "--synthetic", shape, "--num-shards", String(countText),
        "--memory-budget", String(effective.memory_budget)];
      for (const field of ["policy", "chunk_bytes", "optimizer", "data_parallel_workers",
        "layer_regex"]) {
        if (effective[field] !== undefined) {
          dryRun.push(`--${field.replace(/_/g, "-")}`, String(effective[field]));
        }
      }
      const run = spawnSync(shardBinary, dryRun, { encoding: "utf8", timeout: 120000 });
      // The report says "too small:" on stdout; any other refusal is on stderr.
      const tooSmall = (run.stdout ?? "").split("\n").find((line) => line.includes("too small:"));
      if (tooSmall) {
        fail(sts, `memory_budget ${effective.memory_budget} cannot hold the model ` +
          `(layercast-shard --dry-run): ${tooSmall}`);
      } else if (run.status !== 0) {
        const said = (run.stderr ?? "").trim().split("\n").pop();
        fail(sts, `layercast-shard --dry-run refused the set's flags: ${run.error?.message ?? said}`);
      }
    }

    // A selector must pick this set's pods and no other workload's.
    const checkSelector = (obj, selector, what) => {
      if (!selects(selector, podLabels) || ns(obj) !== ns(sts)) {
        fail(obj, `${what} selects no pod of ${id(sts)}`);
      }
      for (const other of workloads) {
        if (other !== sts && ns(other) === ns(obj) &&
            selects(selector, other.spec.template.metadata?.labels)) {
          fail(obj, `${what} also selects the pods of ${id(other)}`);
        }
      }
    };

    // Headless Service named by serviceName: stable per-shard DNS names.
    const service = byKind("Service").find((s) => s.metadata.name === sts.spec.serviceName && ns(s) === ns(sts));
    if (!service) {
      fail(sts, `serviceName ${sts.spec.serviceName} names no Service in the render`);
    } else {
      if (service.spec.clusterIP !== "None") fail(service, "must be headless (clusterIP: None)");
      checkSelector(service, service.spec.selector, "spec.selector");
      for (const p of service.spec.ports ?? []) {
        const target = p.targetPort ?? p.port;
        if (!(typeof target === "number" ? containerPorts.has(target) : portsByName.has(target))) {
          fail(service, `port ${p.name} targets ${target}, which is not a container port`);
        }
      }
    }

    // A publishing set settles a publish whose publisher died through its
    // peers (docs/recovery.md): every shard's stable name, in shard order.
    if (effective.admin_token_file && !effective.optimizer && replicas > 1) {
      // The full name: what a wildcard certificate *.SERVICE.NAMESPACE.svc names.
      const port = portsByName.get("grpc");
      const expected = `${sts.metadata.name}-{i}.${sts.spec.serviceName}.${ns(sts)}.svc:${port}`;
      if (!effective.peers && !effective.peers_file) {
        fail(sts, `the shards take publishes (admin_token_file) but have no peers: set peers to ` +
          `"${expected}", or a publisher that dies mid-publish can leave the set split`);
      } else if (effective.peers && effective.peers !== expected) {
        fail(sts, `peers is ${effective.peers}: the shards' stable names are "${expected}"`);
      }
      if (effective.tls_cert_file && !effective.peer_tls_ca_file && !effective.tls_client_ca_file) {
        fail(sts, "the shards serve TLS and call each other (peers): set peer_tls_ca_file to the " +
          "CA that signed their certificates (e.g. ca.crt of the TLS Secret)");
      }
    }

    for (const pdb of shardObjects("PodDisruptionBudget")) {
      checkSelector(pdb, pdb.spec.selector?.matchLabels, "spec.selector");
      if (pdb.spec.maxUnavailable !== 1) fail(pdb, "maxUnavailable must be 1 (one shard at a time)");
    }

    for (const monitor of shardObjects("PodMonitor")) {
      checkSelector(monitor, monitor.spec.selector?.matchLabels, "spec.selector");
      for (const endpoint of monitor.spec.podMetricsEndpoints ?? []) {
        if (!portsByName.has(endpoint.port)) {
          fail(monitor, `podMetricsEndpoints port '${endpoint.port}' names no container port ` +
            `(have: ${[...portsByName.keys()].join(", ")})`);
        }
      }
      if (!(monitor.spec.podMetricsEndpoints ?? []).length) fail(monitor, "no podMetricsEndpoints");
    }

    // Credential files: each path under a volume mounted in the container;
    // secrets (the key, the token) from a Secret whose mode the shard accepts
    // (it refuses a file others may read, or whose group may do more than
    // read) and can read as a non-root user (Secret files are root's: only
    // fsGroup gives the shard's group access).
    const podSecurity = pod.securityContext ?? {};
    const runAsUser = shard.securityContext?.runAsUser ?? podSecurity.runAsUser;
    for (const [field, secret] of [["tls_cert_file", false], ["tls_key_file", true],
      ["tls_client_ca_file", false], ["peer_tls_ca_file", false], ["admin_token_file", true]]) {
      const file = effective[field];
      if (!file) continue;
      const fileMount = (shard.volumeMounts ?? []).find((m) => file.startsWith(m.mountPath.replace(/\/?$/, "/")));
      const fileVolume = (pod.volumes ?? []).find((v) => v.name === fileMount?.name);
      if (!fileVolume) {
        fail(sts, `the server's ${field} ${file} is under no volume mounted in container ${shard.name}`);
        continue;
      }
      if (!secret) continue;
      if (!fileVolume.secret) {
        fail(sts, `the server's ${field} ${file} must come from a Secret volume, not ` +
          `${Object.keys(fileVolume).filter((k) => k !== "name").join(", ")} (volume ${fileVolume.name})`);
        continue;
      }
      const key = path.posix.relative(fileMount.mountPath, file);
      const item = (fileVolume.secret.items ?? []).find((i) => i.path === key);
      const mode = item?.mode ?? fileVolume.secret.defaultMode ?? 0o644;
      if ((mode & 0o037) !== 0) {
        fail(sts, `volume ${fileVolume.name} gives ${file} mode ${mode.toString(8).padStart(4, "0")}: ` +
          "the shard refuses a private key or token that other users may read; set defaultMode: 0400");
      }
      if (runAsUser !== 0 && podSecurity.fsGroup === undefined) {
        fail(sts, `Secret files belong to root, so the non-root shard cannot read ${file} of mode ` +
          `${mode.toString(8).padStart(4, "0")}: set the pod's securityContext.fsGroup (to its runAsGroup)`);
      }
    }

    // Worker tokens: worker_token_dir is a Secret volume mounted there (one
    // file per key), with a mode the shard accepts for a token.
    const tokenDir = effective.worker_token_dir?.replace(/\/?$/, "");
    if (tokenDir) {
      const tokenMount = (shard.volumeMounts ?? []).find((m) => m.mountPath.replace(/\/?$/, "") === tokenDir);
      const tokenVolume = (pod.volumes ?? []).find((v) => v.name === tokenMount?.name);
      const mode = tokenVolume?.secret?.defaultMode ?? 0o644;
      if (!tokenVolume?.secret) {
        fail(sts, `the server's worker_token_dir ${tokenDir} must be a Secret volume mounted at ` +
          `that path in container ${shard.name} (keys worker-0 .. worker-<N-1>)`);
      } else if ((mode & 0o037) !== 0 || (tokenVolume.secret.items ?? []).some((i) => ((i.mode ?? mode) & 0o037) !== 0)) {
        fail(sts, `volume ${tokenVolume.name} gives the worker tokens mode ${mode.toString(8).padStart(4, "0")}: ` +
          "the shard refuses a token that other users may read; set defaultMode: 0400");
      } else if (runAsUser !== 0 && podSecurity.fsGroup === undefined) {
        fail(sts, `Secret files belong to root, so the non-root shard cannot read the worker tokens: ` +
          "set the pod's securityContext.fsGroup (to its runAsGroup)");
      }
    }

    // Checkpoints must outlive the pod: checkpoint_dir on a volume from the
    // StatefulSet's volumeClaimTemplates (or an existing claim), never on an
    // emptyDir or the container's own filesystem, which die with the pod.
    const checkpointDir = effective.checkpoint_dir;
    if (checkpointDir) {
      const dirMount = (shard.volumeMounts ?? [])
        .filter((m) => (checkpointDir + "/").startsWith(m.mountPath.replace(/\/?$/, "/")))
        .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
      const claims = (sts.spec.volumeClaimTemplates ?? []).map((t) => t.metadata?.name);
      const podVolume = (pod.volumes ?? []).find((v) => v.name === dirMount?.name);
      if (!dirMount) {
        fail(sts, `the server's checkpoint_dir ${checkpointDir} is under no volume mounted in ` +
          `container ${shard.name}: checkpoints would die with the pod; mount a volumeClaimTemplate there`);
      } else if (!claims.includes(dirMount.name) && !podVolume?.persistentVolumeClaim) {
        fail(sts, `the server's checkpoint_dir ${checkpointDir} is on volume ${dirMount.name}, ` +
          "which is not a volumeClaimTemplate or persistentVolumeClaim: checkpoints would die with " +
          "the pod and a restarted shard could not resume");
      } else if (dirMount.readOnly) {
        fail(sts, `the server's checkpoint_dir ${checkpointDir} is mounted read-only`);
      }
    }

    // The NetworkPolicy: it must select exactly the shards, name only their
    // ports, admit every worker on the gRPC port and Prometheus on metrics,
    // and never admit everyone (no `from`) or every port (no `ports`).
    const podTemplateLabels = (w) => w.spec.template.metadata?.labels;
    const workers = workloads.filter((w) => w !== sts &&
      w.spec.template.spec.containers.some((c) => (c.command ?? [])[0] === "layercast"));
    const portOf = (p) => (typeof p.port === "number" ? p.port : portsByName.get(p.port));
    for (const policy of shardObjects("NetworkPolicy").filter((p) => ns(p) === ns(sts))) {
      checkSelector(policy, policy.spec.podSelector?.matchLabels, "spec.podSelector");
      if (policy.spec.policyTypes && !policy.spec.policyTypes.includes("Ingress")) {
        fail(policy, "policyTypes must include Ingress");
      }
      const rules = policy.spec.ingress ?? [];
      rules.forEach((rule, r) => {
        if (!(rule.from ?? []).length) {
          fail(policy, `ingress rule ${r} has no from: it admits every source; name the peers`);
        }
        if (!(rule.ports ?? []).length) {
          fail(policy, `ingress rule ${r} has no ports: it admits every port; name them`);
        }
        for (const p of rule.ports ?? []) {
          if (portOf(p) === undefined || !containerPorts.has(portOf(p))) {
            fail(policy, `ingress rule ${r} port '${p.port}' is not a container port of ${id(sts)}`);
          }
        }
      });
      const admits = (portName, peerMatches) => rules.some((rule) =>
        (rule.ports ?? []).some((p) => portOf(p) === portsByName.get(portName)) &&
        (rule.from ?? []).some(peerMatches));
      for (const w of workers.filter((w) => ns(w) === ns(policy))) {
        const same = (peer) => !peer.namespaceSelector && !peer.ipBlock &&
          selects(peer.podSelector?.matchLabels, podTemplateLabels(w));
        if (!admits("grpc", same)) {
          fail(w, `${id(policy)} admits its pods to no shard's gRPC port: give the pod template a ` +
            "label that an ingress rule for port grpc selects (layercast.io/role: worker)");
        }
      }
      if (byKind("PodMonitor").length && !admits("metrics", (peer) => !!peer.namespaceSelector)) {
        fail(policy, "no ingress rule admits Prometheus (a namespaceSelector peer) to port metrics, " +
          "which the PodMonitor scrapes");
      }
    }

    // Workers of TLS shards must verify them: without --tls-ca-file the
    // layercast tool speaks plaintext, and the handshake never completes.
    for (const w of workers) {
      for (const c of w.spec.template.spec.containers) {
        if ((c.command ?? [])[0] === "layercast" && tls && flag(c.args ?? [], "tls-ca-file") === undefined) {
          fail(w, `container ${c.name}: the shards serve TLS; pass --tls-ca-file (their CA) or it ` +
            "connects in plaintext and fails");
        }
      }
    }

    // Workers: the layercast tool names the shards by pattern and count.
    const port = portsByName.get("grpc");
    const dnsName = `${sts.metadata.name}-{i}.${service?.metadata.name}`;
    const fullName = `${dnsName}.${ns(sts) || "default"}.svc`;
    for (const w of workloads.filter((w) => w !== sts)) {
      for (const c of w.spec.template.spec.containers) {
        if ((c.command ?? [])[0] !== "layercast") continue;
        const wargs = c.args ?? [];
        const pattern = flag(wargs, "shards-pattern");
        const address = splitHostPort(pattern);
        // The short name resolves only from the shards' own namespace.
        const hostOk = address && ((address.host === dnsName && ns(w) === ns(sts)) ||
          address.host === fullName || address.host === `${fullName}.cluster.local`);
        if (!hostOk || address.port !== port) {
          fail(w, `--shards-pattern '${pattern}' must be '${dnsName}:${port}' from the shards' ` +
            `namespace, or '${fullName}:${port}'`);
        }
        const n = flag(wargs, "num-shards");
        const ref = envRef(c, n)?.valueFrom?.configMapKeyRef;
        if (ref ? !(ref.name === countRef?.name && ref.key === countRef?.key) : Number(n) !== replicas) {
          fail(w, `--num-shards ${n} must come from ConfigMap key ${countRef?.key} like the shards'`);
        }
      }
    }
  }

  errors.push(...checkRelays(docs, relays, { byKind, configMaps, ns, selectorOf }));

  // Images must be pinned: a bare name means :latest.
  for (const w of workloads) {
    const pod = w.spec.template.spec;
    for (const c of [...(pod.containers ?? []), ...(pod.initContainers ?? [])]) {
      if (!/[:@]/.test(c.image.split("/").pop()) || c.image.endsWith(":latest")) {
        fail(w, `container ${c.name} image '${c.image}' has no pinned tag`);
      }
    }
  }
  return errors;
}

// The container of `w` that runs `layercast relay`, if any.
function relayContainer(w) {
  return (w.spec?.template?.spec?.containers ?? []).find((c) =>
    (c.command ?? [])[0] === "layercast" && (c.args ?? [])[0] === "relay");
}

// A relay (`layercast relay`, docs/publishing.md) as the shards' checks see
// it is one more reader (its --shards-pattern, --num-shards and the shards'
// NetworkPolicy are checked with the workers'). Here: what it serves and
// who may reach it. One listen address per shard, on all interfaces, each a
// container port; metrics on a container port named metrics and scraped;
// TCP or HTTP probes (a relay has no gRPC health service) on its ports; a
// Service, a PDB, a PodMonitor and a NetworkPolicy that select its pods and
// no other workload's; the policy admitting readers and Prometheus and, if
// it limits egress, letting the relay reach the shards and DNS; and the
// relay's own refusals (TLS, client certificates) caught before it runs.
function checkRelays(docs, relays, { byKind, configMaps, ns, selectorOf }) {
  const errors = [];
  const fail = (obj, message) => errors.push(`${id(obj)}: ${message}`);
  const workloads = docs.filter((d) => d.spec?.template?.spec?.containers);
  const sets = byKind("StatefulSet");
  for (const relay of relays) {
    const container = relayContainer(relay);
    const args = container.args ?? [];
    const labels = relay.spec.template.metadata?.labels ?? {};
    const portsByName = new Map((container.ports ?? []).map((p) => [p.name, p.containerPort]));
    const containerPorts = new Set((container.ports ?? []).map((p) => p.containerPort));
    const portOf = (p) => (typeof p === "number" ? p : portsByName.get(p));
    if (!selects(relay.spec.selector?.matchLabels, labels)) {
      fail(relay, "spec.selector.matchLabels does not match the pod template's labels");
    }

    // One address per shard: as many as the --num-shards it reads.
    const listen = (flag(args, "listen") ?? "").split(",").filter(Boolean).map(splitHostPort);
    const countRef = envRef(container, flag(args, "num-shards"))?.valueFrom?.configMapKeyRef;
    const count = countRef ? Number(configMaps.get(countRef.name)?.data?.[countRef.key]) : undefined;
    if (!listen.length) {
      fail(relay, "layercast relay needs --listen, one 0.0.0.0:<port> per shard in shard order");
    } else if (count !== undefined && listen.length !== count) {
      fail(relay, `--listen names ${listen.length} addresses but ConfigMap ${countRef.name} key ` +
        `${countRef.key} says ${count} shards: give one per shard, in shard order`);
    }
    listen.forEach((address, i) => {
      if (!address || !["0.0.0.0", "[::]"].includes(address.host)) {
        fail(relay, `--listen address ${i} must be 0.0.0.0:<port>: readers and probes dial the pod IP`);
      } else if (!containerPorts.has(address.port)) {
        fail(relay, `--listen port ${address.port} (shard ${i}) is not a container port`);
      }
    });
    const listenPorts = listen.filter(Boolean).map((a) => a.port);
    const metrics = splitHostPort(flag(args, "metrics-listen"));
    if (!metrics || !["0.0.0.0", "[::]"].includes(metrics.host) ||
        portsByName.get("metrics") !== metrics.port) {
      fail(relay, `--metrics-listen ${flag(args, "metrics-listen")} must be 0.0.0.0:<container ` +
        `port named metrics (${portsByName.get("metrics")})>, which the PodMonitor scrapes`);
    }

    // Probes: a relay serves no grpc.health.v1, so a native gRPC probe
    // would fail; TCP (or HTTP on the metrics port) on its own ports.
    for (const probeName of ["livenessProbe", "readinessProbe"]) {
      const probe = container[probeName];
      if (!probe) {
        fail(relay, `container ${container.name} needs a ${probeName} (tcpSocket on a --listen port)`);
      } else if (probe.grpc) {
        fail(relay, `${probeName} is a gRPC probe, but a relay serves no grpc.health.v1: ` +
          "use tcpSocket on a --listen port or the metrics port");
      }
      const port = probe?.tcpSocket?.port ?? probe?.httpGet?.port;
      if (probe && !probe.grpc && (port === undefined || !containerPorts.has(portOf(port)))) {
        fail(relay, `${probeName} port ${port} is not a container port`);
      }
    }

    // Memory: the model and its kept versions live in the process.
    const request = container.resources?.requests?.memory;
    const limit = container.resources?.limits?.memory;
    if (!request || !limit || parseQuantity(request) !== parseQuantity(limit)) {
      fail(relay, `memory request (${request}) must equal memory limit (${limit})`);
    }

    // The relay's own refusals at start, caught here instead of in a crash loop.
    // (The workers' check above requires --tls-ca-file of a reader of TLS shards.)
    const shardsTls = flag(args, "tls-ca-file") !== undefined || flag(args, "tls-cert-file") !== undefined;
    if (shardsTls && flag(args, "serve-tls-cert-file") === undefined && !args.includes("--serve-plaintext")) {
      fail(relay, "the shards are read over TLS (--tls-ca-file) and the relay would serve them in " +
        "plaintext, which it refuses: give --serve-tls-cert-file and --serve-tls-key-file");
    }
    if (flag(args, "tls-cert-file") !== undefined && flag(args, "serve-tls-client-ca-file") === undefined &&
        !args.includes("--serve-without-client-certificates")) {
      fail(relay, "the relay reads the shards with a client certificate (--tls-cert-file) and would " +
        "serve readers without one, which it refuses: give --serve-tls-client-ca-file, or " +
        "--serve-without-client-certificates");
    }

    // Its objects: each selects its pods and no other workload's.
    const mine = (kind) => byKind(kind).filter((o) => ns(o) === ns(relay) && selects(selectorOf(o), labels));
    const onlyMine = (obj) => {
      for (const other of workloads) {
        if (other !== relay && ns(other) === ns(obj) &&
            selects(selectorOf(obj), other.spec.template.metadata?.labels)) {
          fail(obj, `selects the pods of ${id(other)} as well as the relay's`);
        }
      }
    };
    const services = mine("Service");
    if (!services.length) fail(relay, "no Service selects the relay's pods: readers need one");
    for (const service of services) {
      onlyMine(service);
      const targets = (service.spec.ports ?? []).map((p) => portOf(p.targetPort ?? p.port));
      for (const port of listenPorts) {
        if (!targets.includes(port)) fail(service, `exposes no port for the relay's --listen port ${port}`);
      }
      for (const p of service.spec.ports ?? []) {
        if (!containerPorts.has(portOf(p.targetPort ?? p.port))) {
          fail(service, `port ${p.name} targets ${p.targetPort ?? p.port}, which is not a container port`);
        }
      }
      if ((relay.spec.replicas ?? 1) > 1 && service.spec.sessionAffinity !== "ClientIP") {
        fail(service, "sessionAffinity must be ClientIP: a reader's connections (one per shard) " +
          "must reach one relay, and relays may be a version apart");
      }
    }
    const pdbs = mine("PodDisruptionBudget");
    if (!pdbs.length) fail(relay, "no PodDisruptionBudget selects the relay's pods");
    pdbs.forEach(onlyMine);
    const monitors = mine("PodMonitor");
    if (!monitors.length) fail(relay, "no PodMonitor scrapes the relay's metrics port");
    for (const monitor of monitors) {
      onlyMine(monitor);
      const endpoints = monitor.spec.podMetricsEndpoints ?? [];
      if (!endpoints.some((e) => portsByName.get(e.port) === metrics?.port)) {
        fail(monitor, `no podMetricsEndpoints port names the relay's metrics port ` +
          `(have: ${endpoints.map((e) => e.port).join(", ")})`);
      }
    }
    const policies = mine("NetworkPolicy");
    if (!policies.length) fail(relay, "no NetworkPolicy selects the relay's pods: it would serve the model to anyone");
    for (const policy of policies) {
      onlyMine(policy);
      const types = policy.spec.policyTypes ?? ["Ingress"];
      const rules = policy.spec.ingress ?? [];
      if (!types.includes("Ingress")) fail(policy, "policyTypes must include Ingress");
      rules.forEach((rule, r) => {
        if (!(rule.from ?? []).length) fail(policy, `ingress rule ${r} has no from: it admits every source; name the readers`);
        if (!(rule.ports ?? []).length) fail(policy, `ingress rule ${r} has no ports: it admits every port; name them`);
        for (const p of rule.ports ?? []) {
          if (!containerPorts.has(portOf(p.port))) {
            fail(policy, `ingress rule ${r} port '${p.port}' is not a container port of ${id(relay)}`);
          }
        }
      });
      const admitted = (port, peer) => rules.some((rule) =>
        (rule.ports ?? []).some((p) => portOf(p.port) === port) && (rule.from ?? []).some(peer));
      for (const port of listenPorts) {
        if (!admitted(port, (peer) => !!peer.podSelector || !!peer.namespaceSelector)) {
          fail(policy, `no ingress rule admits readers to the relay's --listen port ${port}`);
        }
      }
      if (metrics && !admitted(metrics.port, (peer) => !!peer.namespaceSelector)) {
        fail(policy, "no ingress rule admits Prometheus (a namespaceSelector peer) to port metrics, " +
          "which the PodMonitor scrapes");
      }
      if (types.includes("Egress")) {
        const egress = policy.spec.egress ?? [];
        for (const sts of sets.filter((s) => ns(s) === ns(relay))) {
          const shardLabels = sts.spec.template.metadata?.labels;
          const shardPort = (sts.spec.template.spec.containers ?? []).flatMap((c) => c.ports ?? [])
            .find((p) => p.name === "grpc");
          const reaches = egress.some((rule) =>
            (rule.to ?? []).some((peer) => !peer.namespaceSelector && selects(peer.podSelector?.matchLabels, shardLabels)) &&
            (rule.ports ?? []).some((p) => p.port === shardPort?.containerPort || p.port === shardPort?.name));
          if (!reaches) {
            fail(policy, `limits egress but lets the relay reach no shard of ${id(sts)} on port ` +
              `${shardPort?.containerPort}: it pulls from them and checks every layer against them`);
          }
        }
        if (!egress.some((rule) => (rule.ports ?? []).some((p) => p.port === 53))) {
          fail(policy, "limits egress but allows no DNS (port 53): the relay names the shards by DNS");
        }
      }
    }
  }
  return errors;
}
