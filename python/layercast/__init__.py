"""layercast from Python: layers of a model whose fp32 master lives on shard
servers, gathered just in time in the compute dtype, handed to PyTorch (or any
DLPack consumer) without a copy; and gradients pushed back to the shards, which
run the optimizer on the master.

    import layercast, torch

    shards = layercast.connect(["127.0.0.1:7070", "127.0.0.1:7071"])
    order = range(len(shards.manifest["layers"]))
    for layer in shards.stream(order, budget_bytes=2 << 30):
        weights = {name: torch.from_dlpack(t) for name, t in layer.tensors.items()}
        ...  # use the layer; dropping it (and its tensors) frees its memory

Everything that can wait (connecting, waiting for a layer, pushing) releases
the GIL. Errors from the shards or the worker library raise layercast.Error,
whose `code` is the gRPC status name ("NOT_FOUND", "RESOURCE_EXHAUSTED", ...)
and whose `message` says what to do.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence

from . import _layercast

__all__ = ["connect", "Error", "ShardSet", "LayerStream", "Layer", "Tensor", "PushResult"]


Error = _layercast.Error
Error.__doc__ = """An error from the shards or the worker library: `code` is the gRPC
status name ('NOT_FOUND', 'RESOURCE_EXHAUSTED', ...), `message` what went
wrong and what to do about it."""
Error.message = property(lambda self: self.args[0], doc="What went wrong and what to do.")
Error.code = property(lambda self: self.args[1], doc="The gRPC status code's name.")


Tensor = _layercast.Tensor
Tensor.__doc__ = """One tensor of a gathered layer, in its compute dtype: a view of the
layer's buffer. `torch.from_dlpack(tensor)` (or numpy's, jax's) takes it without
a copy; the result keeps the layer's memory alive, and the stream's budget gets
the bytes back when the last view of the layer is gone. Attributes: name,
shape, dtype ('bfloat16', 'float16', 'float32'), nbytes, data_ptr."""


class Layer:
    """One gathered layer: its tensors by name (`layer["...weight"]` or
    `layer.tensors`), its index, name and version (the parameter version every
    shard cast it from)."""

    def __init__(self, native: _layercast.Layer):
        self._native = native

    @property
    def index(self) -> int:
        return self._native.index

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def version(self) -> int:
        return self._native.version

    @property
    def nbytes(self) -> int:
        """Bytes of the assembled layer buffer, padding included."""
        return self._native.nbytes

    @property
    def data_ptr(self) -> int:
        """Address of the layer's buffer (every tensor lies inside it)."""
        return self._native.data_ptr

    @property
    def tensors(self) -> Dict[str, Tensor]:
        """Every tensor of the layer, in manifest order."""
        return {name: self._native.tensor(name) for name in self._native.names()}

    def __getitem__(self, name: str) -> Tensor:
        return self._native.tensor(name)

    def __repr__(self) -> str:
        return f"<layercast.Layer {self.index} {self.name!r} version {self.version}>"


class LayerStream:
    """The layers of a declared order, gathered ahead in the background within
    a byte budget (see ShardSet.stream). Iterate it; close it (or leave the
    `with` block) to cancel what is in flight. Layers handed out stay valid."""

    def __init__(self, native: _layercast.Stream):
        self._native = native

    def __iter__(self) -> Iterator[Layer]:
        return self

    def __next__(self) -> Layer:
        return Layer(self._native.__next__())

    @property
    def stats(self) -> Dict[str, float]:
        """layers, hits, misses, wait_seconds, peak_bytes, budget_bytes."""
        return self._native.stats

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> "LayerStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PushResult:
    """The pending answer to one push_gradients: `result()` waits for every
    shard to have taken the push and returns {layer, step, layer_version,
    applied}; applied is True when this push completed the layer's step."""

    def __init__(self, native: _layercast.Push):
        self._native = native

    def done(self) -> bool:
        return self._native.done()

    def result(self) -> Dict[str, object]:
        return self._native.result()


class ShardSet:
    """A connection to a whole shard set, which agreed on one model, policy and
    layout. `manifest` describes it; `stream` gathers layers; `push_gradients`
    and `finish_step` train through it. Close it (or leave the `with` block)
    when done: pushes in flight finish first, and layers and tensors still
    held stay valid."""

    def __init__(self, native: _layercast.ShardSet):
        self._native = native

    @property
    def manifest(self) -> Dict[str, object]:
        """model_id, num_shards, policy, version (the model's, its lowest
        layer's, when connecting) and layers: each {index, name, nbytes, tensors: [{name, shape,
        dtype, param_dtype}]}."""
        return self._native.manifest

    @property
    def closed(self) -> bool:
        return self._native.closed

    def stream(self, order: Iterable[int], budget_bytes: int, *, lookahead: Optional[int] = None,
               min_version: int = 0, timeout: float = 60.0) -> LayerStream:
        """Layers in `order` (any list of layer indices, repeats allowed),
        gathered ahead within `budget_bytes` of host memory (layers landed
        ahead plus layers handed out and still referenced) and at most
        `lookahead` layers ahead (unlimited: the budget decides). Each gather
        waits for the layer's version to reach `min_version` and ends within
        `timeout` seconds. A layer larger than the budget is refused here."""
        return LayerStream(self._native.stream(list(order), budget_bytes, lookahead,
                                               min_version, timeout))

    def push_gradients(self, step: int, worker: int, layer: int,
                       gradients: Mapping[str, object]) -> PushResult:
        """Hands over worker `worker`'s gradient of layer `layer`, computed at
        version `step` of it: {tensor name: tensor} for every tensor of the
        layer, each in host memory, contiguous, of the tensor's shape and
        compute dtype (anything with __dlpack__: torch tensors). The bytes are
        copied at once; the push streams to every shard in the background."""
        return PushResult(self._native.push_gradients(step, worker, layer, dict(gradients)))

    def finish_step(self, step: int, worker: int) -> Dict[str, object]:
        """Waits for every push of `worker`; on worker 0 with clipping shards,
        completes the step for every worker (the clip barrier). Returns
        {clipped, total_norm, scale}."""
        return self._native.finish_step(step, worker)

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> "ShardSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(shards: Sequence[str], *, tls: Optional[Mapping[str, str]] = None,
            timeout: float = 30.0) -> ShardSet:
    """Connects to the shard set at `shards` (host:port, in shard order) and
    checks its shards agree. `tls`: {root_certificates, certificate_chain,
    private_key} as PEM strings (mutual TLS with the last two); plaintext
    without. Waits up to `timeout` seconds for shards still starting."""
    if isinstance(shards, str):
        shards = [s.strip() for s in shards.split(",") if s.strip()]
    return ShardSet(_layercast.connect(list(shards), dict(tls) if tls is not None else None,
                                       timeout))
