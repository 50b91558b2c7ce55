#!/usr/bin/env python3
"""A fleet of mirrors following publishes: flat (every mirror pulls from the
shards) against a tree of relays (each mirror a `layercast relay`, following
the one above it, degree 4), in the same run. Goals: the shards' egress per
publish flat in the fleet's size for the tree (at W = 16 at most 1.5x one
mirror's, against about 16x flat), and the time until the last mirror holds
each version at W = 16 at most 2x W = 1's.

Every process gets a link of its own: the bench runs in a network namespace
of its own (nothing outside it is touched), in which each shard and each
mirror is a namespace of its own, joined to one bridge by a veth pair whose
two ends pass packets through a token bucket (tc tbf) at --rate, so the
figures are about links and not about how this machine's cores share out.
The publisher runs on the bridge itself. Needs root (or CAP_NET_ADMIN and
CAP_SYS_ADMIN) and iproute2.

Each publish changes --changed of every tensor's values. The shards'
egress is read from their own metrics (chunk bytes sent, deltas as sent);
a mirror holds a version when its relay logs it.

With --baseline-build OLD (a build of another commit), a star of --star
children (one relay, every other following it) runs twice in the same run,
its relays from OLD/bin/layercast and then from --build: the relays' CPU
per publish and per child, and the root relay's resident memory (peak),
each as a ratio of the new to the old, at --keep-versions.

Usage: PYTHONPATH=build/python python3 bench/fleet_bench.py [--build build]
           [--fleets 1,4,16] [--publishes 10] [--rate 1gbit] [--synthetic SPEC]
           [--baseline-build OLD --star 16 --keep-versions 2]
"""

import argparse
import datetime
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

TOKEN = "fleet-bench-token-0123456789abcdef"
SHARD_PORT, RELAY_PORT, METRICS_PORT = 7070, 7100, 9100
VERSION_LINE = re.compile(r"^(\S+) I layercast: relay: (?:version|holds version) (\d+)")


def sh(*argv):
    subprocess.run(argv, check=True)


def address(node):
    """The node's address on the bridge (the bridge itself is 10.0.255.254)."""
    return f"10.0.{node // 250}.{node % 250 + 1}"


def bits_per_second(rate):
    """tc's rate ("1gbit", "300mbit", "125mbps") in bits per second."""
    match = re.fullmatch(r"([0-9.]+)([kmg]?)(bit|bps)", rate.lower())
    if not match:
        raise SystemExit(f"--rate {rate}: give it as tc does, e.g. 1gbit or 300mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return float(match.group(1)) * scale * (8 if match.group(3) == "bps" else 1)


def add_node(name, node, rate):
    """A namespace joined to the bridge by a veth pair limited to `rate` each way."""
    sh("ip", "netns", "add", name)
    sh("ip", "link", "add", f"v{node}", "type", "veth", "peer", "name", "eth0", "netns", name)
    sh("ip", "link", "set", f"v{node}", "master", "br0", "up")
    sh("ip", "-n", name, "addr", "add", f"{address(node)}/16", "dev", "eth0")
    sh("ip", "-n", name, "link", "set", "eth0", "up")
    sh("ip", "-n", name, "link", "set", "lo", "up")
    # A bucket of 10 ms of the rate (above a timer tick's bytes, which tbf
    # needs to reach it, and far below a publish's delta, which a bigger
    # bucket would let through at memory speed), and a queue gRPC's windows
    # do not see drops from.
    burst = max(64 * 1024, int(bits_per_second(rate) / 8 / 100))
    for netns in ([], ["-n", name]):
        dev = f"v{node}" if not netns else "eth0"
        sh("tc", *netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
           str(burst), "latency", "200ms")


def sandbox():
    """Re-runs this script in a network and mount namespace of its own."""
    if os.environ.get("FLEET_BENCH_SANDBOX") == "1":
        # Namespaces named here are files in a /run/netns of this mount
        # namespace only.
        pathlib.Path("/run/netns").mkdir(parents=True, exist_ok=True)
        sh("mount", "-t", "tmpfs", "tmpfs", "/run/netns")
        sh("ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "addr", "add", "10.0.255.254/16", "dev", "br0")
        sh("ip", "link", "set", "br0", "up")
        return
    for tool in ("ip", "tc", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            raise SystemExit(f"{tool} is missing: apt-get install iproute2 util-linux")
    env = dict(os.environ, FLEET_BENCH_SANDBOX="1")
    os.execvpe("unshare", ["unshare", "--net", "--mount", "--propagation", "private", "--",
                           sys.executable, *sys.argv], env)


def wait_for_file(path, process, what, seconds=120):
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text().strip()):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)


def held_versions(log):
    """(version, UTC seconds) of every version the relay logged holding."""
    held = []
    for line in log.read_text(errors="replace").splitlines():
        match = VERSION_LINE.match(line)
        if match:
            at = datetime.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S.%fZ")
            held.append((int(match.group(2)),
                         at.replace(tzinfo=datetime.timezone.utc).timestamp()))
    return held


def when_held(log, version, seconds=120):
    """When the relay first logged holding `version` or a later one."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for held, at in held_versions(log):
            if held >= version:
                return at
        time.sleep(0.02)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
    raise SystemExit(f"{log} never held version {version}:\n{tail}")


def cpu_seconds(processes):
    """User and system CPU the processes have used so far."""
    total = 0
    for process in processes:
        fields = pathlib.Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def egress(shards):
    """Chunk bytes the shards sent, deltas counted as sent."""
    total = 0.0
    for node in shards:
        text = urllib.request.urlopen(f"http://{address(node)}:{METRICS_PORT}/metrics",
                                      timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("layercast_sent_bytes_total"):
                total += float(line.split()[-1])
            elif line.startswith('layercast_delta_bytes_total{kind="delta"}'):
                total += float(line.split()[-1])
            elif line.startswith('layercast_delta_bytes_total{kind="full"}'):
                total -= float(line.split()[-1])
    return total


def peak_rss(process):
    """The process's peak resident memory (VmHWM), bytes."""
    for line in pathlib.Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_fleet(args, directory, shard_nodes, shard_set, values, version, fleet, tree, first_node,
              binary=None, star=False):
    """Starts `fleet` relays (flat, a tree of degree 4 rooted at the
    shards' one child, or a star: every other relay follows the first),
    from `binary` (the build's layercast by default), follows
    `args.publishes` publishes, stops them. Returns (egress bytes per
    publish, seconds to the last mirror per publish, the mirrors' CPU
    seconds per publish, the version published last, and the first relay's
    CPU seconds per publish and peak resident bytes)."""
    binary = binary or f"{args.build}/bin/layercast"
    shards = ",".join(f"{address(n)}:{SHARD_PORT}" for n in shard_nodes)
    processes, logs = [], []
    for m in range(fleet):
        node = first_node + m
        name = f"m{node}"
        add_node(name, node, args.rate)
        ports = pathlib.Path(directory) / f"{name}.ports"
        log = pathlib.Path(directory) / f"{name}.log"
        listen = ",".join(f"{address(node)}:{RELAY_PORT + s}" for s in range(len(shard_nodes)))
        argv = ["ip", "netns", "exec", name, binary, "relay", "--shards", shards, "--listen",
                listen, "--port-file", str(ports), "--keep-versions", str(args.keep_versions)]
        if (tree or star) and m > 0:
            parent = first_node + (0 if star else (m - 1) // 4)
            argv += ["--upstream", ",".join(f"{address(parent)}:{RELAY_PORT + s}"
                                            for s in range(len(shard_nodes)))]
        with open(log, "w") as err:
            processes.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err))
        logs.append(log)
        wait_for_file(ports, processes[-1], f"relay {m}")
    for log in logs:
        when_held(log, version)
    sent, seconds = [], []
    cpu = cpu_seconds(processes)
    root_cpu = cpu_seconds(processes[:1])
    try:
        for _ in range(args.publishes):
            step = version % 7
            for tensor in values.values():
                tensor.view(-1)[step::int(1 / args.changed)] *= 1.01
            before = egress(shard_nodes)
            shard_set.publish(values, TOKEN, insecure=True)
            start = time.time()  # committed: from here the version is the shards'
            version += 1
            seconds.append(max(when_held(log, version) for log in logs) - start)
            sent.append(egress(shard_nodes) - before)
        cpu = (cpu_seconds(processes) - cpu) / args.publishes
        root_cpu = (cpu_seconds(processes[:1]) - root_cpu) / args.publishes
        root_rss = peak_rss(processes[0])
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)
        for m in range(fleet):
            node = first_node + m
            sh("ip", "link", "del", f"v{node}")
            sh("ip", "netns", "del", f"m{node}")
    return sent, seconds, cpu, version, (root_cpu, root_rss)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--num-shards", type=int, default=2)
    # About 100 MB in bf16.
    parser.add_argument("--synthetic",
                        default="llama:layers=8,hidden=640,ffn=1792,vocab=8000,seed=5")
    parser.add_argument("--fleets", default="1,4,16")
    parser.add_argument("--publishes", type=int, default=10)
    parser.add_argument("--changed", type=float, default=1 / 32,
                        help="share of every tensor's values each publish changes")
    parser.add_argument("--rate", default="1gbit", help="each process's link, as tc says it")
    parser.add_argument("--keep-versions", type=int, default=1)
    parser.add_argument("--baseline-build",
                        help="another commit's build: its relays against --build's, as a star")
    parser.add_argument("--star", type=int, default=16, help="children of the star's relay")
    args = parser.parse_args()
    args.build = os.path.abspath(args.build)
    if args.baseline_build:
        args.baseline_build = os.path.abspath(args.baseline_build)
    sandbox()
    sys.path.insert(0, f"{args.build}/python")
    import layercast
    import layercast.torch

    fleets = [int(w) for w in args.fleets.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        token = pathlib.Path(directory) / "token"
        token.write_text(TOKEN + "\n")
        os.chmod(token, 0o600)
        shard_nodes = list(range(args.num_shards))
        processes = []
        try:
            for i in shard_nodes:
                add_node(f"s{i}", i, args.rate)
                ports = pathlib.Path(directory) / f"s{i}.port"
                processes.append(subprocess.Popen(
                    ["ip", "netns", "exec", f"s{i}", f"{args.build}/bin/layercast-shard",
                     "--listen", f"{address(i)}:{SHARD_PORT}", "--port-file", str(ports),
                     "--shard-index", str(i), "--num-shards", str(args.num_shards),
                     "--synthetic", args.synthetic, "--admin-token-file", str(token),
                     "--metrics-listen", f"{address(i)}:{METRICS_PORT}"],
                    stderr=subprocess.DEVNULL))
                wait_for_file(ports, processes[-1], f"shard {i}")
            addresses = [f"{address(i)}:{SHARD_PORT}" for i in shard_nodes]
            with layercast.connect(addresses) as shard_set:
                path = pathlib.Path(directory) / "master.safetensors"
                values = layercast.torch.load_safetensors(shard_set.export(str(path))["files"][0])
                path.unlink()
                nbytes = sum(t.numel() * 2 for t in values.values())
                print(f"{args.synthetic}: {nbytes / 1e6:.1f} MB in bf16 on {args.num_shards} "
                      f"shards; each process's link {args.rate}; {args.publishes} publishes per "
                      f"fleet, each changing {args.changed:.1%} of every tensor's values",
                      flush=True)
                version, node = 0, 100
                results = {}
                for fleet in fleets:
                    for tree in (False, True):
                        sent, seconds, cpu, version, _ = run_fleet(args, directory, shard_nodes,
                                                              shard_set, values, version, fleet,
                                                              tree, node)
                        node += fleet
                        results[(fleet, tree)] = (statistics.median(sent),
                                                  statistics.median(seconds), cpu)
                        print(f"  W={fleet:3d} {'tree' if tree else 'flat'}: shards' egress "
                              f"{results[(fleet, tree)][0] / 1e6:8.2f} MB per publish, "
                              f"last mirror {results[(fleet, tree)][1] * 1e3:8.1f} ms after the "
                              f"commit (medians); the mirrors' CPU {cpu:.2f} s per publish",
                              flush=True)
                if args.baseline_build:
                    star = {}
                    for label, binary in (("old", f"{args.baseline_build}/bin/layercast"),
                                          ("new", f"{args.build}/bin/layercast")):
                        _, seconds, cpu, version, (root_cpu, rss) = run_fleet(
                            args, directory, shard_nodes, shard_set, values, version,
                            args.star + 1, False, node, binary=binary, star=True)
                        node += args.star + 1
                        star[label] = (cpu / (args.star + 1), rss, statistics.median(seconds),
                                       root_cpu)
                        print(f"  star of {args.star} children, {label} relays: CPU "
                              f"{star[label][0] * 1e3:.1f} ms per publish per relay, the root's "
                              f"{root_cpu * 1e3:.1f} ms (serving its children), the root's "
                              f"peak RSS {rss / 2**20:.0f} MiB, last mirror "
                              f"{star[label][2] * 1e3:.1f} ms after the commit", flush=True)
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)
    if args.baseline_build:
        print(f"star of {args.star} at --keep-versions {args.keep_versions}, new / old: CPU per "
              f"publish per relay {star['new'][0] / star['old'][0]:.2f}x, the root's "
              f"{star['new'][3] / star['old'][3]:.2f}x, the root's peak RSS "
              f"{star['new'][1] / star['old'][1]:.2f}x")
    one = results[(fleets[0], False)]
    big = fleets[-1]
    for tree in (False, True):
        sent, seconds, _ = results[(big, tree)]
        print(f"W={big} {'tree' if tree else 'flat'} / W={fleets[0]}: egress {sent / one[0]:.2f}x, "
              f"time to the last mirror {seconds / one[1]:.2f}x")


if __name__ == "__main__":
    main()
