#!/usr/bin/env python3
"""The Python package's layer iterator against the C++ LayerStream, over the
same shards in the same run (goal: >= 0.95x; the binding adds no copy and
holds no lock while it waits).

Starts N shards on 127.0.0.1 serving a synthetic model, then alternates, R
times each: `layercast bench` (a C++ LayerStream walk, budget 3 layers) and
`shard_set.stream(...)` from Python with the same order and budget, each
layer's tensors taken by torch.from_dlpack (zero-copy) and dropped, each
timed from the stream's creation to the last layer's arrival. Reports the
medians and their ratio.

Usage: PYTHONPATH=build/python python3 bench/python_stream_bench.py [--build build]
           [--num-shards 2] [--synthetic SPEC] [--walks 3] [--repeats 5]
"""

import argparse
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def start_shards(build, n, synthetic, directory, flags=()):
    """N shards on 127.0.0.1 serving `synthetic`, with `flags` besides."""
    processes, addresses = [], []
    for i in range(n):
        port_file = pathlib.Path(directory) / f"port-{i}"
        processes.append(subprocess.Popen(
            [f"{build}/bin/layercast-shard", "--listen", "127.0.0.1:0", "--port-file",
             str(port_file), "--shard-index", str(i), "--num-shards", str(n), "--synthetic",
             synthetic, *flags], stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            if processes[-1].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"shard {i} did not start")
            time.sleep(0.05)
        addresses.append(f"127.0.0.1:{int(port_file.read_text())}")
    return processes, addresses


def stop_shards(processes):
    """SIGTERM every shard start_shards started, and waits for each (bounded)."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        process.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--synthetic", default="llama:layers=8,hidden=1024,ffn=2816,vocab=8000,seed=3")
    parser.add_argument("--walks", type=int, default=3, help="walks over every layer per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, f"{args.build}/python")
    import torch
    import layercast

    with tempfile.TemporaryDirectory() as directory:
        processes, addresses = start_shards(args.build, args.num_shards, args.synthetic, directory)
        try:
            shard_set = layercast.connect(addresses)
            layers = shard_set.manifest["layers"]
            order = [layer["index"] for layer in layers] * args.walks
            budget = 3 * max(layer["nbytes"] for layer in layers)
            wire = sum(layers[i]["nbytes"] for i in order)
            cpp, python = [], []
            for _ in range(args.repeats + 1):  # the first of each: a warm-up
                run = subprocess.run(
                    [f"{args.build}/bin/layercast", "bench", "--shards", ",".join(addresses),
                     "--rounds", str(args.walks), "--budget-layers", "3"],
                    capture_output=True, text=True, check=True)
                cpp.append(float(re.search(r" in ([0-9.]+) s:", run.stdout).group(1)))
                # Timed as `layercast bench` times its walk: from the stream's
                # creation to the last layer's arrival.
                with shard_set.stream(order, budget) as stream:
                    start = time.perf_counter()
                    for layer in stream:
                        elapsed = time.perf_counter() - start
                        views = [torch.from_dlpack(t) for t in layer.tensors.values()]
                        del views, layer
                python.append(elapsed)
            shard_set.close()
        finally:
            stop_shards(processes)
    cpp_s, python_s = statistics.median(cpp[1:]), statistics.median(python[1:])
    print(f"python_stream_bench: {args.synthetic}, {args.num_shards} shards, {len(order)} layers "
          f"per walk, budget 3 layers, median of {args.repeats}")
    print(f"(a) C++ LayerStream (layercast bench)   {cpp_s:7.3f} s  {wire / cpp_s / 1e9:6.2f} GB/s")
    print(f"(b) Python iterator, torch views         {python_s:7.3f} s  {wire / python_s / 1e9:6.2f} GB/s")
    print(f"a/b {cpp_s / python_s:.3f} (Python throughput against C++; goal >= 0.95)")


if __name__ == "__main__":
    main()
