#!/usr/bin/python3
"""End-to-end checks of layercast's metrics, alerts and dashboard.

Runs against real processes on 127.0.0.1 only:
  1. promtool checks and unit-tests deploy/prometheus/alerts.yml;
  2. two layercast-shard processes serve a small synthetic model; the test
     gathers every layer, runs a bench and sends one bad request, then checks
     the exposition with `promtool check metrics` and checks that the counters
     moved by exactly what was delivered;
  3. a real Prometheus scrapes both shards and a relay of them every second
     and loads alerts.yml; every query of deploy/grafana/layercast.json must
     return data.

Standard library only (Debian's /usr/bin/python3); needs promtool and
prometheus from the Debian package `prometheus` (scripts/install-deps.sh).
Run from the source root, as CTest does:
  observability_test.py --shard-binary build/bin/layercast-shard --cli-binary build/bin/layercast
Prints "observability: N passed, M failed" last; exits non-zero on a failure.
"""

import argparse
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

ALERTS = "deploy/prometheus/alerts.yml"
ALERTS_TEST = "deploy/prometheus/alerts_test.yml"
DASHBOARD = "deploy/grafana/layercast.json"
METRICS_DOC = "docs/metrics.md"

NUM_SHARDS = 2
SYNTHETIC = "llama:layers=2,hidden=256"
# Three compute dtypes, so sent bytes are checked summed over dtypes, an 8-bit
# one's block scales among them.
POLICY = "params=float32,compute=bfloat16,output=float32,fp8_block=128;*norm*=float32;*down_proj*=float8_e4m3fn"
BUDGET_BYTES = 256 << 20  # a budget, so the budget-use panel has data
BENCH_ROUNDS = 2

# Dashboard variables as Grafana would expand them, for a 1 s scrape interval
# ($__rate_interval is at least four scrape intervals).
DASHBOARD_VARIABLES = {
    "__rate_interval": "10s",
    "__interval": "2s",
    "__range": "1m",
    "job": ".*",
    "shard": ".*",
}

SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4,
                           "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class Checks:
    """Counts named pass/fail checks; a failed check does not stop the run."""

    def __init__(self):
        self.passed = 0
        self.failed = []

    def check(self, name, ok, detail=""):
        if ok:
            self.passed += 1
            print(f"PASS {name}" + (f": {detail}" if detail else ""), flush=True)
        else:
            self.failed.append(name)
            print(f"FAIL {name}" + (f": {detail}" if detail else ""), flush=True)
        return ok


class Deadline:
    """Every wait in this test is bounded in time."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return max(0.0, self.end - time.monotonic())

    def expired(self):
        return time.monotonic() >= self.end


# --- processes ------------------------------------------------------------

_children = []  # every long-lived process this test started


def _die_with_parent():
    # PR_SET_PDEATHSIG: if this test is killed outright (a CTest timeout sends
    # SIGKILL), the kernel still sends SIGTERM to the shards and Prometheus.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def start(cmd, log_path):
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=_die_with_parent)
    log.close()
    _children.append(proc)
    return proc


def stop_all():
    for proc in _children:
        if proc.poll() is None:
            proc.terminate()  # shards drain their streams on SIGTERM
    for proc in _children:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    _children.clear()


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through main's finally: stop_all()


def run(cmd, timeout=60):
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def tail(path, lines=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def free_port():
    # Racy (someone may take it before Prometheus binds); start_prometheus retries.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- shards -----------------------------------------------------------------

class Shard:
    def __init__(self, index, grpc_addr, metrics_addr, log):
        self.index, self.grpc_addr, self.metrics_addr, self.log = index, grpc_addr, metrics_addr, log


def start_shard(binary, index, tmp):
    port_file = os.path.join(tmp, f"shard{index}.port")
    log = os.path.join(tmp, f"shard{index}.log")
    proc = start([binary, "--num-shards", str(NUM_SHARDS), "--shard-index", str(index),
                  "--synthetic", SYNTHETIC, "--policy", POLICY,
                  "--memory-budget", str(BUDGET_BYTES),
                  "--listen", "127.0.0.1:0", "--port-file", port_file,
                  "--metrics-listen", "127.0.0.1:0"], log)
    # The port file appears once gRPC listens; the metrics port (0 picks one)
    # is only in the log: "metrics on 127.0.0.1:PORT/metrics".
    deadline = Deadline(60)  # generous: sanitizer builds start slowly
    metrics_addr = None
    while not deadline.expired() and proc.poll() is None:
        if metrics_addr is None:
            m = re.search(r"metrics on (127\.0\.0\.1:\d+)/metrics", tail(log, 50))
            metrics_addr = m.group(1) if m else None
        if metrics_addr and os.path.exists(port_file) and "ready" in tail(log, 50):
            with open(port_file) as f:
                port = f.read().strip()
            if port:
                return Shard(index, f"127.0.0.1:{port}", metrics_addr, log)
        time.sleep(0.1)
    raise RuntimeError(f"shard {index} did not start (exit {proc.poll()}):\n{tail(log)}")


def start_relay(cli_binary, shards, tmp):
    """A `layercast relay` of the shards, whose metrics Prometheus scrapes too
    (the dashboard's relay panels)."""
    port_file = os.path.join(tmp, "relay.ports")
    log = os.path.join(tmp, "relay.log")
    metrics_addr = f"127.0.0.1:{free_port()}"
    proc = start([cli_binary, "relay", "--shards", ",".join(s.grpc_addr for s in shards),
                  "--listen", ",".join(["127.0.0.1:0"] * len(shards)), "--port-file", port_file,
                  "--metrics-listen", metrics_addr], log)
    deadline = Deadline(60)
    while not deadline.expired() and proc.poll() is None:
        if os.path.exists(port_file) and "relay: holds version" in tail(log, 50):
            with open(port_file) as f:
                return Shard("relay", f.read().strip(), metrics_addr, log)
        time.sleep(0.1)
    raise RuntimeError(f"the relay did not start (exit {proc.poll()}):\n{tail(log)}")


def scrape(shard):
    with urllib.request.urlopen(f"http://{shard.metrics_addr}/metrics", timeout=10) as r:
        return r.read().decode()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text):
    """Samples of the text format as (name, {label: value}, float)."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return samples


def metric_families(text):
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)", text, re.M)}


def total(samples, name, **labels):
    return sum(v for n, l, v in samples
               if n == name and all(l.get(k) == want for k, want in labels.items()))


def totals(shards, name, **labels):
    return sum(total(parse_exposition(scrape(s)), name, **labels) for s in shards)


def grpc_fetch_layer(addr, layer, timeout=10.0):
    """Sends one FetchLayer(layer) over plaintext HTTP/2 and waits for it to end.

    `layercast fetch` checks the layer index against the manifest and never
    sends a bad one, and Debian's python3 has no gRPC module, so a request the
    server must refuse is built by hand: the HTTP/2 preface, one HEADERS frame
    (HPACK literals, no Huffman coding) and one DATA frame holding the
    protobuf FetchLayerRequest{layer}. The server's counters, not this
    function, say what status it returned. Returns True once stream 1 ended.
    """
    def frame(ftype, flags, stream, payload):
        return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload

    def header(name, value):  # literal without indexing, new name
        name, value = name.encode(), value.encode()
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    assert 0 <= layer < 128  # a one-byte varint keeps the encoding trivial
    request = b"\x08" + bytes([layer])  # field 1 (layer), varint
    host, port = addr.rsplit(":", 1)
    headers = b"".join(header(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"),
        (":path", "/layercast.v1.ShardService/FetchLayer"), (":authority", addr),
        ("content-type", "application/grpc"), ("te", "trailers")])
    message = b"\x00" + struct.pack(">I", len(request)) + request  # uncompressed gRPC message
    DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0, 1, 3, 4, 7
    END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
    deadline = Deadline(timeout)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0, b"")
                  + frame(HEADERS, END_HEADERS, 1, headers) + frame(DATA, END_STREAM, 1, message))
        buf = b""
        while not deadline.expired():
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                length = int.from_bytes(buf[:3], "big")
                ftype, flags = buf[3], buf[4]
                stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                buf = buf[9 + length:]
                if ftype == SETTINGS and not flags & ACK:
                    s.sendall(frame(SETTINGS, ACK, 0, b""))
                if stream == 1 and (ftype == RST_STREAM or (ftype in (DATA, HEADERS) and flags & END_STREAM)):
                    return True
                if ftype == GOAWAY:
                    return False
            s.settimeout(max(0.1, deadline.left()))
            data = s.recv(65536)
            if not data:
                return False
            buf += data
    return False


def safetensors_totals(path):
    """(bytes, elements) of every tensor in a safetensors file, from its header;
    an 8-bit tensor's block scales (`<name>_scale`) count as bytes, not elements."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    nbytes = elements = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        n = math.prod(t["shape"])
        begin, end = t["data_offsets"]
        if end - begin != n * SAFETENSORS_DTYPE_BYTES[t["dtype"]]:
            raise ValueError(f"{path}: {name}: {end - begin} bytes for {n} {t['dtype']} elements")
        nbytes += end - begin
        scales_of = name.removesuffix("_scale")
        if not (name != scales_of and header.get(scales_of, {}).get("dtype", "").startswith("F8_")):
            elements += n
    return nbytes, elements


# --- prometheus -------------------------------------------------------------

def start_prometheus(tmp, shards, relay, checks):
    config = os.path.join(tmp, "prometheus.yml")
    with open(config, "w") as f:
        # JSON is YAML; absolute rule path because Prometheus resolves it
        # against the config file's folder.
        json.dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.abspath(ALERTS)],
            "scrape_configs": [{"job_name": "layercast",
                                "static_configs": [{"targets": [s.metrics_addr for s in shards]}]},
                               {"job_name": "layercast-relay",
                                "static_configs": [{"targets": [relay.metrics_addr]}]}],
        }, f, indent=2)
    for attempt in range(3):
        port = free_port()
        log = os.path.join(tmp, f"prometheus{attempt}.log")
        proc = start(["prometheus", f"--config.file={config}",
                      f"--storage.tsdb.path={os.path.join(tmp, f'tsdb{attempt}')}",
                      f"--web.listen-address=127.0.0.1:{port}"], log)
        url = f"http://127.0.0.1:{port}"
        deadline = Deadline(30)
        while not deadline.expired() and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        checks.check("prometheus starts and loads alerts.yml", True, url)
                        return url
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        proc.terminate()
        proc.wait(timeout=15)
        print(f"prometheus attempt {attempt + 1} failed:\n{tail(log)}", flush=True)
    raise RuntimeError("prometheus did not become ready")


def prom_query(url, expr):
    """(ok, result list or error text) of an instant query."""
    q = urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:  # 400/422 carry the PromQL error
        body = json.load(e)
    except (urllib.error.URLError, OSError) as e:
        return False, str(e)
    if body.get("status") != "success":
        return False, f"{body.get('errorType')}: {body.get('error')}"
    return True, body["data"]["result"]


def expand_variables(expr):
    unknown = []

    def sub(m):
        name = m.group(1) or m.group(2)
        if name not in DASHBOARD_VARIABLES:
            unknown.append(name)
            return m.group(0)
        return DASHBOARD_VARIABLES[name]

    # $name, ${name} and ${name:format}
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr), unknown


def dashboard_queries(dashboard):
    """(where, expr) of every panel target, rows' panels included."""
    found = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    found.append((f"{p.get('title')} [{t.get('refId')}]", t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    return found


def describe(result):
    values = [r["value"][1] for r in result[:3]]
    return f"{len(result)} series, e.g. {', '.join(values)}"


# --- the test ---------------------------------------------------------------

def check_rules(checks):
    promtool = shutil.which("promtool")
    if not checks.check("promtool installed", promtool is not None,
                        "" if promtool else "install the Debian package prometheus"):
        return
    r = run([promtool, "check", "rules", ALERTS])
    checks.check("promtool check rules", r.returncode == 0, (r.stdout + r.stderr).strip())
    r = run([promtool, "test", "rules", ALERTS_TEST])
    checks.check("promtool test rules", r.returncode == 0, (r.stdout + r.stderr).strip())


def check_shards(checks, args, tmp, shards):
    cli = args.cli_binary
    addrs = ",".join(s.grpc_addr for s in shards)
    before = [parse_exposition(scrape(s)) for s in shards]

    for s, samples in zip(shards, before):
        checks.check(f"shard {s.index} layercast_ready is 1", total(samples, "layercast_ready") == 1)
        info = [l for n, l, _ in samples if n == "layercast_shard_info"]
        checks.check(f"shard {s.index} layercast_shard_info labels",
                     len(info) == 1 and info[0].get("shard_index") == str(s.index)
                     and info[0].get("num_shards") == str(NUM_SHARDS) and info[0].get("policy") == POLICY
                     and int(info[0].get("incarnation", "0"), 16) > 0,
                     str(info))
        checks.check(f"shard {s.index} layercast_memory_budget_bytes",
                     total(samples, "layercast_memory_budget_bytes") == BUDGET_BYTES)
        # The process metrics: this shard's own RSS, from /proc, above its
        # fp32 master (which it holds) and below the machine's memory.
        rss = total(samples, "process_resident_memory_bytes")
        master = total(samples, "layercast_master_bytes")
        checks.check(f"shard {s.index} process_resident_memory_bytes holds its master",
                     master < rss < 64 * 2**30, f"rss {rss}, master {master}")
        checks.check(f"shard {s.index} process metrics", total(samples, "process_open_fds") > 0
                     and total(samples, "process_start_time_seconds") > time.time() - 3600
                     and any(n == "process_cpu_seconds_total" for n, _, _ in samples), "")
        # Series that exist before any call of their kind.
        checks.check(f"shard {s.index} PushGradients OK series at zero from start-up",
                     any(n == "layercast_rpcs_total" and l == {"method": "PushGradients", "code": "OK"}
                         and v == 0 for n, l, v in samples))
        # A fresh set's dashboard shows zeros, not "No data": every dtype the
        # policy sends, and the cast error of every narrowing one, from start.
        checks.check(f"shard {s.index} sent_bytes_total per compute dtype at zero from start-up",
                     {l.get("dtype") for n, l, v in samples
                      if n == "layercast_sent_bytes_total" and v == 0}
                     >= {"bfloat16", "float32", "float8_e4m3fn"}, "")
        checks.check(f"shard {s.index} cast_relative_error series from start-up",
                     any(n == "layercast_cast_relative_error_count" and l.get("dtype") == "bfloat16"
                         and v == 0 for n, l, v in samples), "")

    # One round: gather every layer with `layercast fetch`, so the expected
    # byte count comes from the files' safetensors headers, not from the
    # server's own accounting.
    r = run([cli, "manifest", "--shards", addrs])
    m = re.search(r"^layers\s+(\d+)", r.stdout, re.M)
    if not checks.check("layercast manifest", r.returncode == 0 and m is not None, r.stderr.strip()):
        return
    num_layers = int(m.group(1))
    checks.check("layercast_layers equals the manifest's layer count",
                 all(total(b, "layercast_layers") == num_layers for b in before))
    round_bytes = round_elements = 0
    for layer in range(num_layers):
        out = os.path.join(tmp, f"layer{layer}.safetensors")
        r = run([cli, "fetch", "--shards", addrs, "--layer", str(layer), "--out", out])
        if not checks.check(f"layercast fetch --layer {layer}", r.returncode == 0, r.stderr.strip()):
            return
        nbytes, elements = safetensors_totals(out)
        round_bytes += nbytes
        round_elements += elements
    r = run([cli, "bench", "--shards", addrs, "--rounds", str(BENCH_ROUNDS)], timeout=120)
    checks.check("layercast bench", r.returncode == 0, (r.stdout.strip().splitlines() or [""])[-1])

    after = [parse_exposition(scrape(s)) for s in shards]

    def delta(name, **labels):
        return (sum(total(a, name, **labels) for a in after)
                - sum(total(b, name, **labels) for b in before))

    rounds = 1 + BENCH_ROUNDS
    sent = delta("layercast_sent_bytes_total")
    checks.check("sent_bytes_total (all dtypes) rose by exactly the bytes delivered",
                 sent == rounds * round_bytes, f"{sent:.0f} vs {rounds} x {round_bytes}")
    dtypes = sorted({l["dtype"] for a in after for n, l, _ in a if n == "layercast_sent_bytes_total"})
    checks.check("sent_bytes_total has a series per compute dtype used",
                 dtypes == ["bfloat16", "float32", "float8_e4m3fn"], str(dtypes))
    params = delta("layercast_sent_parameters_total")
    checks.check("sent_parameters_total rose by exactly the elements delivered",
                 params == rounds * round_elements, f"{params:.0f} vs {rounds} x {round_elements}")
    for s, b, a in zip(shards, before, after):
        ok = total(a, "layercast_rpcs_total", method="FetchLayer", code="OK") \
            - total(b, "layercast_rpcs_total", method="FetchLayer", code="OK")
        hist = total(a, "layercast_fetch_duration_seconds_count") \
            - total(b, "layercast_fetch_duration_seconds_count")
        checks.check(f"shard {s.index} counted one OK FetchLayer per layer gathered",
                     ok == rounds * num_layers, f"{ok:.0f} vs {rounds} x {num_layers}")
        checks.check(f"shard {s.index} fetch_duration histogram counted every OK stream",
                     hist == ok, f"{hist:.0f} vs {ok:.0f}")
    cast_in = delta("layercast_cast_input_bytes_total")
    # Rounds a few seconds apart share casts (SharedChunks): every element is
    # cast at least once, and each chunk sent without a cast is counted shared.
    shared = delta("layercast_chunks_total", source="shared")
    cast_chunks = delta("layercast_chunks_total", source="cast")
    checks.check("cast_input_bytes_total counts fp32 master bytes cast, each at least once",
                 4 * round_elements <= cast_in <= 4 * rounds * round_elements,
                 f"{cast_in:.0f} vs 4 x {round_elements} x 1..{rounds}")
    checks.check("chunks_total{source=shared} rose exactly when casts were saved",
                 (shared > 0) == (cast_in < 4 * rounds * round_elements) and cast_chunks > 0,
                 f"shared {shared:.0f}, cast {cast_chunks:.0f}, cast input {cast_in:.0f}")

    # Cast error: every bf16 element cast is measured, and bf16 rounds a
    # normal value (the synthetic model has no others) within 2^-8, so the
    # 2^-8 bucket holds them all while the exact bucket (2^-24) does not.
    measured = delta("layercast_cast_relative_error_count", dtype="bfloat16")
    def bucket(bound):
        # `le` as the exposition spells it, found by value.
        spelt = {l["le"] for a in after for n, l, _ in a
                 if n == "layercast_cast_relative_error_bucket" and l.get("le") != "+Inf"
                 and float(l["le"]) == bound}
        return sum(delta("layercast_cast_relative_error_bucket", dtype="bfloat16", le=le) for le in spelt)

    within = bucket(2.0**-8)
    exact = bucket(2.0**-24)
    checks.check("cast_relative_error measured bf16 elements, each cast within 2^-8",
                 0 < measured <= cast_in / 4 and within == measured and exact < measured,
                 f"measured {measured:.0f}, within 2^-8 {within:.0f}, within 2^-24 {exact:.0f}, "
                 f"cast {cast_in / 4:.0f}")
    lost = delta("layercast_cast_lost_elements_total", dtype="bfloat16")
    hows = sorted({l["how"] for a in after for n, l, _ in a if n == "layercast_cast_lost_elements_total"})
    checks.check("cast_lost_elements_total: a series per kind, none lost by bf16",
                 lost == 0 and hows == ["became_subnormal", "flushed_to_zero", "overflowed"],
                 f"lost {lost:.0f}, kinds {hows}")

    # Bad requests. The CLI refuses layer 99 itself, before any RPC; the raw
    # request must reach shard 0 and be counted as exactly one NOT_FOUND.
    r = run([cli, "fetch", "--shards", addrs, "--layer", "99", "--out", os.path.join(tmp, "x.safetensors")])
    checks.check("layercast fetch --layer 99 fails", r.returncode != 0, r.stderr.strip())
    from_cli = totals(shards, "layercast_rpcs_total", code="NOT_FOUND")
    print(f"     (NOT_FOUND counted for the CLI's layer 99: {from_cli:.0f})", flush=True)
    ended = grpc_fetch_layer(shards[0].grpc_addr, 99)
    not_found = totals(shards, "layercast_rpcs_total", method="FetchLayer", code="NOT_FOUND")
    checks.check("one bad FetchLayer counts exactly one NOT_FOUND",
                 ended and not_found == from_cli + 1, f"stream ended: {ended}, NOT_FOUND {not_found:.0f}")

    # promtool lints the text format (names, units, HELP/TYPE, histograms).
    for s in shards:
        r = subprocess.run(["promtool", "check", "metrics"], input=scrape(s), capture_output=True,
                           text=True, timeout=30)
        checks.check(f"promtool check metrics (shard {s.index})", r.returncode == 0,
                     (r.stdout + r.stderr).strip())


def check_docs_and_dashboard_names(checks, shards, relay):
    exposition = scrape(shards[0])
    families = {n for n in metric_families(exposition) if n.startswith("layercast_")}
    with open(METRICS_DOC) as f:
        doc = f.read()
    documented = set(re.findall(r"`(layercast_\w+)`", doc))
    checks.check(f"{METRICS_DOC} documents every exported layercast_ metric",
                 not families - documented, f"missing: {sorted(families - documented)}")
    # Histogram series (_bucket, _sum, _count) may be named in prose.
    series = {n for n, _, _ in parse_exposition(exposition)}
    checks.check(f"{METRICS_DOC} names no metric the server does not export",
                 not documented - families - series, f"unknown: {sorted(documented - families - series)}")
    series |= {n for n, _, _ in parse_exposition(scrape(relay))}

    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    named = {n for _, e in dashboard_queries(dashboard) for n in re.findall(r"\blayercast_\w+", e)}
    checks.check(f"{DASHBOARD} names only exported metrics", named and named <= series,
                 f"unknown: {sorted(named - series)}" if named - series else f"{len(named)} metrics")


def drive_traffic(args, shards, seconds):
    """Bench runs for `seconds`, so every rate has data, with a refused request
    every tenth run: the error panels get a nonzero rate while the error ratio
    stays far below LayercastErrorRate's 5%."""
    addrs = ",".join(s.grpc_addr for s in shards)
    deadline = Deadline(seconds)
    runs = 0
    while not deadline.expired():
        if runs % 10 == 0:
            grpc_fetch_layer(shards[runs // 10 % len(shards)].grpc_addr, 99)
        run([args.cli_binary, "bench", "--shards", addrs, "--rounds", "2"], timeout=60)
        runs += 1
    return runs


def check_prometheus(checks, args, tmp, shards, relay):
    found = shutil.which("prometheus")
    if not checks.check("prometheus installed", found is not None,
                        found or "install the Debian package prometheus"):
        return
    url = start_prometheus(tmp, shards, relay, checks)

    # Both targets scraped, a few times, before any rate can be computed.
    deadline = Deadline(30)
    up = []
    while not deadline.expired():
        ok, up = prom_query(url, 'up{job="layercast"} == 1')
        if ok and len(up) == NUM_SHARDS:
            break
        time.sleep(0.5)
    if not checks.check("prometheus scrapes both shards", len(up) == NUM_SHARDS, f"{len(up)} targets up"):
        return
    time.sleep(2)
    runs = drive_traffic(args, shards, 6)
    run([args.cli_binary, "bench", "--shards", relay.grpc_addr, "--rounds", "1"], timeout=60)
    time.sleep(2.5)  # the last traffic reaches a scrape
    print(f"     ({runs} bench runs of traffic)", flush=True)

    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    queries = dashboard_queries(dashboard)
    checks.check("dashboard has queries", len(queries) > 0, f"{len(queries)} queries")
    for where, expr in queries:
        expanded, unknown = expand_variables(expr)
        if unknown:
            checks.check(f"dashboard query {where}", False, f"unknown variables {unknown}: {expr}")
            continue
        ok, result = prom_query(url, expanded)
        checks.check(f"dashboard query {where}", ok and len(result) > 0,
                     (describe(result) if ok and result else result if not ok else "no series")
                     + f"  <- {expanded}")

    # Template variables: label_values(SELECTOR, LABEL) must find values.
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q or ""
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", q)
        if not checks.check(f"dashboard variable ${var['name']} is label_values()", m is not None, q):
            continue
        selector, _ = expand_variables(m.group(1))
        ok, result = prom_query(url, selector)
        values = sorted({r["metric"].get(m.group(2), "") for r in result}) if ok else []
        checks.check(f"dashboard variable ${var['name']} has values", ok and values and "" not in values,
                     str(values if ok else result))

    # The real Prometheus loaded the rules, evaluates them without error, and
    # none would fire on this healthy shard set.
    deadline = Deadline(15)
    rules = []
    while not deadline.expired():
        try:
            with urllib.request.urlopen(f"{url}/api/v1/rules?type=alert", timeout=10) as r:
                rules = [rule for g in json.load(r)["data"]["groups"] for rule in g["rules"]]
        except (urllib.error.URLError, OSError):
            rules = []
        if rules and all(rule.get("health") == "ok" for rule in rules):
            break
        time.sleep(0.5)
    defined = len(re.findall(r"^\s*- alert:", open(ALERTS).read(), re.M))
    checks.check("prometheus evaluates every alert rule", len(rules) == defined
                 and all(rule.get("health") == "ok" for rule in rules),
                 ", ".join(f"{rule['name']}: {rule.get('health')} {rule.get('lastError', '')}".strip()
                           for rule in rules))
    for rule in rules:
        ok, result = prom_query(url, rule["query"])
        checks.check(f"alert {rule['name']} quiet on a healthy shard set", ok and result == [],
                     str(result)[:300])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-binary", required=True)
    parser.add_argument("--cli-binary", required=True)
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    checks = Checks()
    tmp = tempfile.mkdtemp(prefix="layercast-observability-")
    shards = []
    try:
        check_rules(checks)
        shards = [start_shard(args.shard_binary, i, tmp) for i in range(NUM_SHARDS)]
        check_shards(checks, args, tmp, shards)
        relay = start_relay(args.cli_binary, shards, tmp)
        check_docs_and_dashboard_names(checks, shards, relay)
        check_prometheus(checks, args, tmp, shards, relay)
    except Exception as e:  # a broken step fails the run, and cleanup still happens
        checks.check("test ran to the end", False, f"{type(e).__name__}: {e}")
    except SystemExit as e:  # a signal (see _on_signal): still clean up and summarize
        checks.check("test ran to the end", False, f"stopped by signal {e.code - 128}")
    finally:
        stop_all()
    if checks.failed:
        for s in shards:
            print(f"--- {s.log}\n{tail(s.log)}", flush=True)
        print(f"logs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"observability: {checks.passed} passed, {len(checks.failed)} failed", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
