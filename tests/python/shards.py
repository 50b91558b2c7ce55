"""Real layercast-shard processes on 127.0.0.1 for the Python package's tests,
and a small safetensors writer for the models they serve."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
from typing import Dict, List, Sequence

import torch

SHARD_BINARY = os.environ.get("LAYERCAST_SHARD_BINARY", "")


def write_safetensors(path: pathlib.Path, tensors: Dict[str, torch.Tensor]) -> None:
    """The safetensors format by hand (an 8-byte header length, a JSON header,
    the raw little-endian bytes): Debian ships no safetensors package."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def llama_tensors(layers: int = 3, hidden: int = 64, ffn: int = 96, vocab: int = 50,
                  seed: int = 5) -> Dict[str, torch.Tensor]:
    """A small Llama-named fp32 model, deterministic."""
    g = torch.Generator().manual_seed(seed)
    t: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        t[p + "mlp.gate_proj.weight"] = torch.randn(ffn, hidden, generator=g) * 0.05
        t[p + "mlp.up_proj.weight"] = torch.randn(ffn, hidden, generator=g) * 0.05
        t[p + "mlp.down_proj.weight"] = torch.randn(hidden, ffn, generator=g) * 0.05
        t[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    t["model.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    t["lm_head.weight"] = torch.randn(vocab, hidden, generator=g) * 0.05
    return t


class ShardSet:
    """N shard processes serving one model; stop() (or the with block) ends them."""

    def __init__(self, directory: pathlib.Path, num_shards: int, flags: Sequence[str]):
        if not SHARD_BINARY:
            raise RuntimeError("set LAYERCAST_SHARD_BINARY to the layercast-shard binary")
        self.processes: List[subprocess.Popen] = []
        self.addresses: List[str] = []
        self.directory = directory
        port_files = []
        for i in range(num_shards):
            port_file = directory / f"shard-{i}.port"
            port_file.unlink(missing_ok=True)
            log = open(directory / f"shard-{i}.log", "wb")
            self.processes.append(subprocess.Popen(
                [SHARD_BINARY, "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                 "--shard-index", str(i), "--num-shards", str(num_shards), *flags],
                stdout=log, stderr=subprocess.STDOUT))
            port_files.append(port_file)
        deadline = time.monotonic() + 60
        for i, port_file in enumerate(port_files):
            while not (port_file.exists() and port_file.read_text().strip()):
                if self.processes[i].poll() is not None:
                    self.stop()
                    log = (directory / f"shard-{i}.log").read_text(errors="replace")
                    raise RuntimeError(f"shard {i} exited before listening:\n{log}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"shard {i} did not start listening within 60 s")
                time.sleep(0.02)
            self.addresses.append(f"127.0.0.1:{int(port_file.read_text())}")

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "ShardSet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
