"""Real layercast-shard processes on 127.0.0.1 for the Python package's tests,
and a small model for them to serve."""

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


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, so equality is bitwise (NaNs, -0)."""
    return tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


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
    # A layer of one element: with 2 shards, shard 0 owns none of it.
    t[f"model.layers.{layers}.layer_scale"] = torch.ones(1)
    t["model.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    t["lm_head.weight"] = torch.randn(vocab, hidden, generator=g) * 0.05
    return t


class ShardSet:
    """N shard processes serving one model; stop() (or the with block) ends them."""

    def __init__(self, directory: pathlib.Path, num_shards: int, flags: Sequence[str]):
        if not SHARD_BINARY:
            raise RuntimeError("set LAYERCAST_SHARD_BINARY to the layercast-shard binary")
        self.directory = directory
        self.num_shards = num_shards
        self.flags = list(flags)
        self.processes: List[subprocess.Popen] = []
        for i in range(num_shards):
            self.processes.append(self._spawn(i, "127.0.0.1:0"))
        self.addresses = [self._await_port(i) for i in range(num_shards)]

    def _spawn(self, i: int, listen: str) -> subprocess.Popen:
        port_file = self.directory / f"shard-{i}.port"
        port_file.unlink(missing_ok=True)
        log = open(self.directory / f"shard-{i}.log", "ab")
        return subprocess.Popen(
            [SHARD_BINARY, "--listen", listen, "--port-file", str(port_file),
             "--shard-index", str(i), "--num-shards", str(self.num_shards), *self.flags],
            stdout=log, stderr=subprocess.STDOUT)

    def _await_port(self, i: int) -> str:
        port_file = self.directory / f"shard-{i}.port"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.processes[i].poll() is not None:
                self.stop()
                log = (self.directory / f"shard-{i}.log").read_text(errors="replace")
                raise RuntimeError(f"shard {i} exited before listening:\n{log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"shard {i} did not start listening within 60 s")
            time.sleep(0.02)
        return f"127.0.0.1:{int(port_file.read_text())}"

    def restart(self, i: int) -> None:
        """SIGTERM (the shard drains and checkpoints), then the same shard
        again on the same port: it resumes from its --checkpoint-dir."""
        self.processes[i].send_signal(signal.SIGTERM)
        self.processes[i].wait(timeout=60)
        self.processes[i] = self._spawn(i, self.addresses[i])
        assert self._await_port(i) == self.addresses[i]

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


CLI_BINARY = os.environ.get("LAYERCAST_CLI_BINARY", "")


class Relay:
    """A `layercast relay` process of `shards` on 127.0.0.1 (port 0: free
    ones), its addresses in `addresses`; stop() (or the with block) ends it.
    signal() sends it one and says the process took it; start() starts it
    again on the same addresses."""

    def __init__(self, directory: pathlib.Path, name: str, shards: Sequence[str]):
        if not CLI_BINARY:
            raise RuntimeError("set LAYERCAST_CLI_BINARY to the layercast binary")
        self.directory = directory
        self.name = name
        self.shards = list(shards)
        self.addresses = ["127.0.0.1:0"] * len(self.shards)
        self.process: subprocess.Popen = None  # type: ignore[assignment]
        self.start()

    def start(self) -> None:
        port_file = self.directory / f"{self.name}.ports"
        port_file.unlink(missing_ok=True)
        log = open(self.directory / f"{self.name}.log", "ab")
        self.process = subprocess.Popen(
            [CLI_BINARY, "relay", "--shards", ",".join(self.shards), "--listen",
             ",".join(self.addresses), "--port-file", str(port_file)],
            stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = (self.directory / f"{self.name}.log").read_text(errors="replace")
                raise RuntimeError(f"relay {self.name} did not start listening:\n{text}")
            time.sleep(0.02)
        self.addresses = port_file.read_text().strip().split(",")

    def state(self) -> str:
        """The process's state letter in /proc (T: stopped, R/S: running)."""
        stat = pathlib.Path(f"/proc/{self.process.pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]

    def stop_signal(self) -> None:
        """SIGSTOP, and waits (bounded) until the kernel says it stopped."""
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while self.state() != "T":
            assert time.monotonic() < deadline, f"relay {self.name} did not stop"
            time.sleep(0.005)

    def kill(self) -> None:
        """SIGKILL, reaped: asserts that is how it ended."""
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(timeout=10) == -signal.SIGKILL

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def read_safetensors(path: pathlib.Path) -> Dict[str, torch.Tensor]:
    """The fp32 tensors of a safetensors file (a shard's checkpoint holds its
    slice of each tensor, flattened)."""
    data = pathlib.Path(path).read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or name.startswith("__optimizer__"):
            continue
        begin, end = info["data_offsets"]
        assert info["dtype"] == "F32", (name, info["dtype"])
        tensors[name] = (torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=torch.float32)
                         if end > begin else torch.empty(0))
    return tensors
