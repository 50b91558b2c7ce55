#!/usr/bin/env python3
"""How long a mirror update holds its readers off: staged (the moved layers
pulled into copies while readers read on, then copied in) against in place
(readers held off for the whole pull), two mirrors of the same shards
following the same publishes in the same run (goal: the staged pause well
under the in-place one; the staged update costs one more copy).

Starts N read-only shards on 127.0.0.1 serving a synthetic model, reads its
fp32 master back (ShardSet.export), then R times: changes a third of every
tensor's values, publishes them, and updates both mirrors. Reports each
mirror's median pause and update time, and the ratio of the pauses.

Usage: PYTHONPATH=build/python python3 bench/mirror_pause_bench.py [--build build]
           [--num-shards 2] [--synthetic SPEC] [--publishes 7]
"""

import argparse
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from python_stream_bench import start_shards, stop_shards  # noqa: E402

TOKEN = "mirror-pause-bench-token-0123456789"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--synthetic", default="llama:layers=8,hidden=512,ffn=1536,vocab=8000,seed=3")
    parser.add_argument("--publishes", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, f"{args.build}/python")
    import layercast
    import layercast.torch

    with tempfile.TemporaryDirectory() as directory:
        token = pathlib.Path(directory) / "token"
        token.write_text(TOKEN + "\n")
        os.chmod(token, 0o600)
        processes, addresses = start_shards(args.build, args.num_shards, args.synthetic,
                                            directory, ["--admin-token-file", str(token)])
        try:
            with layercast.connect(addresses) as shard_set:
                path = pathlib.Path(directory) / "master.safetensors"
                values = layercast.torch.load_safetensors(shard_set.export(str(path))["files"][0])
                mirrors = {"in place": shard_set.mirror(),
                           "staged": shard_set.mirror(staging_bytes=1 << 40)}
                pauses = {name: [] for name in mirrors}
                updates = {name: [] for name in mirrors}
                for step in range(args.publishes):
                    for tensor in values.values():
                        tensor.view(-1)[step % 3::3] *= 1.01
                    shard_set.publish(values, TOKEN, insecure=True)
                    for name, mirror in mirrors.items():
                        update = mirror.update()
                        pauses[name].append(update["pause_seconds"])
                        updates[name].append(update["seconds"])
                for mirror in mirrors.values():
                    mirror.stop()
        finally:
            stop_shards(processes)
    nbytes = sum(t.numel() * 2 for t in values.values())
    print(f"{args.synthetic}: {nbytes / 2**20:.1f} MiB in bf16 on {args.num_shards} shards, "
          f"{args.publishes} publishes, each changing a third of every tensor")
    for name in mirrors:
        print(f"  {name:9s} pause median {statistics.median(pauses[name]) * 1e3:8.2f} ms, "
              f"update median {statistics.median(updates[name]) * 1e3:8.2f} ms")
    ratio = statistics.median(pauses["staged"]) / statistics.median(pauses["in place"])
    print(f"staged pause / in-place pause: {ratio:.3f}x")


if __name__ == "__main__":
    main()
