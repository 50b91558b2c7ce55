"""layercast from Python: layers of a model whose fp32 master lives on shard
servers, gathered just in time in the compute dtype, handed to PyTorch (or any
DLPack consumer) without a copy; gradients pushed back to the shards, which
run the optimizer on the master; and new weights published by a trainer,
which mirrors of the whole model follow by pulling only what changed.

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

import collections.abc
import logging
import os
import threading
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set

from . import _layercast

# The worker library's defaults, in seconds, as client/client_defaults.h
# writes them once.
_DEFAULTS = _layercast.defaults

__all__ = [
    "connect", "learning_rate", "Error", "LayerIndexError", "ShardSet", "LayerStream", "Layer", "Tensor",
    "PushResult", "Mirror", "MirrorReading"
]


Error = _layercast.Error
Error.__doc__ = """An error from the shards or the worker library: `code` is the gRPC
status name ('NOT_FOUND', 'RESOURCE_EXHAUSTED', ...), `message` what went
wrong and what to do about it."""
Error.message = property(lambda self: self.args[0], doc="What went wrong and what to do.")
Error.code = property(lambda self: self.args[1], doc="The gRPC status code's name.")
Error.__str__ = lambda self: f"{self.args[0]} ({self.args[1]})" if len(self.args) == 2 else \
    super(Error, self).__str__()


class LayerIndexError(Error, IndexError):
    """A layer index outside the model: an Error (code NOT_FOUND) that is
    also the IndexError a Python sequence raises."""


def _route_native_logs() -> None:
    """The worker library's log lines go to the "layercast" logger (not
    straight to stderr), read from a pipe by a daemon thread: the library's
    own threads never take the GIL."""
    read_fd, write_fd = os.pipe()
    _layercast.route_logs(write_fd)
    # spdlog's levels: trace, debug, info, warn, err, critical.
    levels = [logging.DEBUG, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
              logging.CRITICAL]
    logger = logging.getLogger("layercast")

    def pump() -> None:
        with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace", newline="\n") as lines:
            for line in lines:
                level, _, message = line.rstrip("\n").partition(" ")
                try:
                    logger.log(levels[min(int(level), len(levels) - 1)], "%s", message)
                except Exception:  # a handler's failure must not stop the pump
                    logging.exception("layercast: a log line could not be handled")

    threading.Thread(target=pump, name="layercast-logs", daemon=True).start()


_route_native_logs()


def _check_layer_indices(indices: Iterable[int], count: int) -> None:
    for index in indices:
        if not 0 <= index < count:
            raise LayerIndexError(f"layer {index} does not exist: this model has {count} layers "
                                  f"(0-{count - 1})", "NOT_FOUND")


Tensor = _layercast.Tensor
Tensor.__doc__ = """One tensor of a gathered layer, in its compute dtype: a view of the
layer's buffer. `torch.from_dlpack(tensor)` (or numpy's, jax's) takes it without
a copy; the result keeps the layer's memory alive, and the stream's budget gets
the bytes back when the last view of the layer is gone. Attributes: name,
shape, dtype ('bfloat16', 'float16', 'float32', 'float8_e4m3fn',
'float8_e5m2'), nbytes, data_ptr, block_size and scales.

An 8-bit float tensor exports its codes as uint8 (DLPack has no fp8 for the
consumers this package supports) and has `scales`, another Tensor: float32 of
shape [ceil(elements / block_size)], so element i is value(code[i]) *
scales[i // block_size]; `layercast.torch.dequantize` does that. Other
tensors have block_size 0 and scales None.

numpy has no bfloat16, so numpy.from_dlpack refuses a bfloat16 tensor:
`tensor.bits()` is the same bytes as unsigned integers of the element's
width (uint16 for bfloat16), which numpy.from_dlpack takes, still without
a copy; or go through torch
(`torch.from_dlpack(tensor).float().numpy()`, a copy)."""


class Layer(collections.abc.Mapping):
    """One gathered layer, a read-only mapping of tensor names to tensors
    (`layer["...weight"]`, `dict(layer)`, `layer.tensors`), with its index,
    name and version (the parameter version every shard cast it from)."""

    def __init__(self, native: _layercast.Layer):
        self._native = native
        self._names = tuple(native.names())

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

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

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
        """layers, hits, misses, landed, wait_seconds, peak_bytes, budget_bytes."""
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


class MirrorReading:
    """The mirror held at one version while the `with` block runs: updates
    wait until it ends, so every layer read through it is at `version`.
    Asking the mirror for its version, an update or another reading from
    inside the block, on the same thread, raises RuntimeError: it would
    wait for the block forever."""

    def __init__(self, native: _layercast.MirrorReading, readers: Set[int],
                 indices: Mapping[str, int]):
        self._native = native
        self._indices = indices
        # The threads inside a reading of the mirror, shared with it.
        self._readers = readers
        self._reader = threading.get_ident()
        readers.add(self._reader)

    @property
    def version(self) -> int:
        """The lowest layer's version (after a publish, every layer's)."""
        return self._native.version

    def __len__(self) -> int:
        return self._native.num_layers

    def layer(self, key) -> Layer:
        """Layer `key`, an index or a layer name ("model.layers.3"; KeyError
        for a name the model lacks): its tensors are views of the mirror's
        buffers (torch.from_dlpack takes them without a copy). They stay
        valid as long as anything holds them; their values are this
        reading's while it lasts, and move on in place with each update
        after it."""
        if isinstance(key, str):
            if key not in self._indices:
                raise KeyError(f"the model has no layer {key!r}; its layers are "
                               f"{list(self._indices)}")
            key = self._indices[key]
        _check_layer_indices([key], len(self))
        return Layer(self._native.layer(key))

    __getitem__ = layer

    def names(self) -> List[str]:
        """The layers' names, in model order."""
        return list(self._indices)

    def check(self) -> None:
        """Raises Error (DATA_LOSS) when a failed pull left layers holding a
        mix of two versions; the next update repairs them."""
        self._native.check()

    def close(self) -> None:
        self._readers.discard(self._reader)
        self._native.close()

    def __enter__(self) -> "MirrorReading":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Mirror:
    """The whole model held in host memory at the shards' newest version, for
    an inference worker (see ShardSet.mirror). `follow()` keeps it current in
    the background: each new version the shards commit (a publish, an
    optimizer step) is pulled as a delta, only the values that changed,
    written in place. Read it inside `with mirror.read() as r:`."""

    def __init__(self, native: _layercast.Mirror, names: Sequence[str]):
        self._native = native
        self._readers: Set[int] = set()
        self._names = list(names)
        self._indices = {name: index for index, name in enumerate(self._names)}

    @property
    def addresses(self) -> List[str]:
        """Where the mirror serves the set's reads (ShardSet.mirror(serve=)),
        one "host:port" per shard; empty when it does not."""
        return list(self._native.addresses)

    def _named(self, update: Dict[str, object]) -> Dict[str, object]:
        update["changed_layers"] = [self._names[i] for i in update["changed_layers"]]
        return update

    def _not_reading(self, what: str) -> None:
        # The reading holds the mirror's lock on this thread: asking for it
        # again would wait for itself (abseil aborts the interpreter).
        if threading.get_ident() in self._readers:
            raise RuntimeError(f"{what} inside `with mirror.read()` on the same thread would wait "
                               f"for the reading itself: use the reading's version and layers, "
                               f"or leave the block first")

    @property
    def version(self) -> int:
        """The lowest version any layer holds; answered at once."""
        self._not_reading("mirror.version")
        return self._native.version

    def update(self, min_version: Optional[int] = None) -> Dict[str, object]:
        """Brings every layer to at least `min_version` (default: the
        version the shards serve now) by delta pulls. Returns {version,
        layers, bytes, seconds, changed_layers, staged_layers,
        pause_seconds}: layers pulled, bytes received, the names of the
        layers whose values changed (a publish moves every layer's version,
        most of them changing nothing), those pulled into staging copies,
        and how long readers were held off."""
        self._not_reading("mirror.update()")
        return self._named(self._native.update(min_version))

    def wait_for_version(self, version: int, timeout: float = 30.0) -> bool:
        """Waits until every layer holds `version` or newer; False when
        `timeout` seconds passed first."""
        self._not_reading("mirror.wait_for_version()")
        return self._native.wait_for_version(version, timeout)

    def follow(self, on_update: Optional[Callable[[Dict[str, object]], None]] = None) -> None:
        """Starts following the shards on a background thread; `on_update`
        gets each update's dict (as update() returns, changed_layers
        included), on that thread."""
        if on_update is None:
            self._native.follow(None)
        else:
            self._native.follow(lambda update: on_update(self._named(update)))

    def stop(self) -> None:
        """Stops following, cancelling the poll or update in flight (one
        cancelled midway leaves the layers as they were); returns within a
        fraction of a second."""
        self._native.stop()

    @property
    def source(self) -> List[str]:
        """The set the mirror pulls from now: the one it was made from, or
        one of its fallbacks (ShardSet.mirror(fallbacks=)), as "host:port"
        per shard."""
        return list(self._native.source)

    def read(self) -> MirrorReading:
        """Holds updates off until the reading is closed (use `with`). Never
        waits on the network: an update pulls into copies while readers read
        on (ShardSet.mirror(staging_bytes=)), holding them off only to copy
        the layers that changed in."""
        self._not_reading("mirror.read()")
        return MirrorReading(self._native.read(), self._readers, self._indices)

    def __enter__(self) -> "Mirror":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ShardSet:
    """A connection to a whole shard set, which agreed on one model, policy and
    layout. `manifest` describes it; `stream` gathers layers; `push_gradients`
    and `finish_step` train through it. Close it (or leave the `with` block)
    when done: pushes in flight finish first, and layers and tensors still
    held stay valid."""

    def __init__(self, native: _layercast.ShardSet):
        self._native = native
        self._num_layers = len(native.manifest["layers"])

    @property
    def manifest(self) -> Dict[str, object]:
        """model_id, num_shards, policy, held_dtype, version (the model's, its
        lowest layer's, when connecting) and layers: each {index, name, nbytes,
        grad_nbytes, tensors: [{name, shape, dtype, policy_dtype, param_dtype,
        grad_dtype}]}. It says what the shards serve: dtype and nbytes are as
        they hold them, the policy's compute dtypes (policy_dtype) but for a
        relay started with --dtype, which holds every tensor in held_dtype
        ("float8_e4m3fn"; None elsewhere). grad_dtype is the dtype
        push_gradients takes: the compute dtype, but float32 for 8-bit floats."""
        return self._native.manifest

    @property
    def closed(self) -> bool:
        return self._native.closed

    def stream(self, order: Iterable[int], budget_bytes: int, *, lookahead: Optional[int] = None,
               min_version: int = 0, version: Optional[int] = None,
               timeout: float = _DEFAULTS.layer_timeout) -> LayerStream:
        """Layers in `order` (any list of layer indices, repeats allowed),
        gathered ahead within `budget_bytes` of host memory (layers landed
        ahead plus layers handed out and still referenced) and at most
        `lookahead` layers ahead (unlimited: the budget decides). Each gather
        waits for the layer's version to reach `min_version` and ends within
        `timeout` seconds. A layer larger than the budget is refused here.

        `version` pins the walk: every layer at exactly that version (take
        it from `version()`), even while newer versions are published; the
        shards keep a superseded version for a while (--pin-retention-ms),
        and a layer whose version they no longer keep raises Error
        (ABORTED, naming the version to walk again at)."""
        order = list(order)
        _check_layer_indices(order, self._num_layers)
        return LayerStream(self._native.stream(order, budget_bytes, lookahead, min_version,
                                               version, timeout))

    def version(self) -> int:
        """The version the shards serve now (shard 0's lowest layer's)."""
        return self._native.version()

    def push_gradients(self, step: int, worker: int, layer: int,
                       gradients: Mapping[str, object]) -> PushResult:
        """Hands over worker `worker`'s gradient of layer `layer`, computed at
        version `step` of it: {tensor name: tensor} for every tensor of the
        layer, each in host memory, contiguous, of the tensor's shape and its
        manifest grad_dtype (the compute dtype; float32 for 8-bit floats), as
        anything with __dlpack__ (torch tensors). The bytes are copied at
        once; the push streams to every shard in the background."""
        _check_layer_indices([layer], self._num_layers)
        return PushResult(self._native.push_gradients(step, worker, layer, dict(gradients)))

    def finish_step(self, step: int, worker: int) -> Dict[str, object]:
        """Waits for every push of `worker`; on worker 0 with clipping shards,
        completes the step for every worker (the clip barrier). Returns
        {clipped, total_norm, scale}."""
        return self._native.finish_step(step, worker)

    def export(self, path: str, *, dtype: str = "float32", version: Optional[int] = None,
               max_file_bytes: int = 5_000_000_000,
               timeout: float = _DEFAULTS.layer_timeout) -> Dict[str, object]:
        """Writes the whole model at one version as a safetensors model that
        safetensors, PyTorch and Hugging Face transformers load (and a shard
        serves again with --model): every tensor the shards serve, named and
        shaped as the manifest says, in `dtype` ("float32": the fp32 master
        as it is; "bfloat16" or "float16": a cast of it, as the shards cast).
        `path` ends in ".safetensors"; a model over `max_file_bytes` is split
        as save_pretrained splits it ("<stem>-00001-of-0000N.safetensors"
        and "<path>.index.json"). `version`: default, the shards' current
        one. Each layer's gather ends within `timeout` seconds. Files appear
        under their names only once all are complete (a failed export
        leaves none behind). The optimizer's state is not in it:
        layercast.torch.export_checkpoint writes the master and that state,
        for torch.optim, from the checkpoint training shards wrote. Returns
        {version, bytes, tensors, files}."""
        if not str(path).endswith(".safetensors"):
            raise ValueError(f"path {str(path)!r} does not end in .safetensors: name the file, "
                             f"e.g. 'model.safetensors'")
        if dtype not in _EXPORT_DTYPES:
            raise ValueError(f"dtype {dtype!r} cannot be exported: use 'float32' (the master), "
                             f"'bfloat16' or 'float16'")
        return self._native.export(str(path), dtype, version, max_file_bytes, timeout)

    def mirror(self, *, timeout: float = _DEFAULTS.layer_timeout,
               poll: float = _DEFAULTS.mirror_poll,
               dtype: Optional[str] = None, staging_bytes: Optional[int] = None,
               serve: Optional[Sequence[str]] = None,
               fallbacks: Optional[Sequence[object]] = None,
               probe: float = _DEFAULTS.mirror_probe) -> Mirror:
        """Pulls every layer in full into a Mirror (each pull within
        `timeout` seconds); `poll`: how long each of its long polls for a new
        version lasts once it follows. `dtype` ("float8_e4m3fn", ...): every
        tensor in it rather than the policy's, cast by the shards from the
        same fp32 master (an fp8 inference fleet following shards that
        trainers gather in bfloat16); updates from the shards then pull
        the layers that moved in full, since shards serve no delta in such
        a dtype (a mirror or relay serving in it does).
        `staging_bytes`: an update pulls the layers that moved into copies,
        up to this many bytes, while readers read on, and holds them off
        only to copy the changed ones in (None, the default: every layer
        that moves, so `read()` never waits on the network; 0: pulls in
        place, readers held off for the whole update; no second copy).
        `serve`: one "host:port" per shard, in shard order (port 0 picks a
        free one; Mirror.addresses says which): the mirror also serves the
        set's reads there, as `layercast relay` does, so other mirrors
        connect() to it instead of to the shards.
        `fallbacks`: where to follow from, in order, when this set (a relay,
        typically) dies or stops answering: each a ShardSet (connect() it,
        with TLS if needed) or a list of "host:port" (connected here in
        plaintext) serving the same model, such as the shards the relay
        follows or other relays of them. While following, the mirror probes
        its source every `probe` seconds (a call answered at once, within
        `probe`): one that refuses connections or does not answer is left
        within about 2 * `probe`, and a source preferred to the one
        followed is gone back to once it answers again, caught up (0: no
        probes; a source is left only when a call to it fails)."""
        if serve is not None and len(serve) != self.manifest["num_shards"]:
            raise ValueError(f"serve names {len(serve)} addresses: give one per shard, "
                             f"{self.manifest['num_shards']}, in shard order")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one the shards cast to: use one of "
                             f"{', '.join(_DTYPES[:5])}")
        if probe < 0:
            raise ValueError(f"probe is {probe}: give seconds between probes, or 0 for none")
        natives = []
        for fallback in fallbacks or []:
            if isinstance(fallback, ShardSet):
                natives.append(fallback._native)
            elif isinstance(fallback, (str, collections.abc.Sequence)):
                natives.append(connect(fallback, timeout=timeout)._native)
            else:
                raise TypeError(f"a fallback is a ShardSet or a list of 'host:port', not "
                                f"{type(fallback).__name__}")
        return Mirror(self._native.mirror(timeout, poll, dtype or "", staging_bytes,
                                          list(serve or []), natives, probe),
                      [layer["name"] for layer in self.manifest["layers"]])

    def publish(self, values: Mapping[str, object], admin_token: str, *,
                base_version: Optional[int] = None, timeout: float = _DEFAULTS.publish_timeout,
                insecure: bool = False) -> Dict[str, object]:
        """Publishes new fp32 values, {tensor name: tensor}, to read-only
        shards as the next version of every layer: all shards commit it or
        none does. Every tensor of a layer named must be given, each in host
        memory, contiguous, float32 and of its shape (taken without a copy);
        the other layers keep their values. `admin_token`: the shards'
        --admin-token-file (surrounding whitespace, such as a file's
        newline, is trimmed; a token no header can carry raises Error with
        code INVALID_ARGUMENT).
        `base_version`: the version the values replace (default: the one
        the shards serve). The token is refused over a connection without
        TLS unless `insecure` (loopback testing only). Returns {version,
        changed_elements, layer_by_layer, versions}."""
        return self._native.publish(dict(values), admin_token, base_version, timeout, insecure)

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> "ShardSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "f32", "bf16",
           "f16", "f8e4m3", "f8e5m2")
_EXPORT_DTYPES = ("float32", "bfloat16", "float16", "f32", "bf16", "f16")


def learning_rate(optimizer: str, step: int, tensor: Optional[str] = None) -> float:
    """The learning rate shards started with --optimizer `optimizer` (the
    manifest's "optimizer") apply at 1-based `step` (the step that makes
    version `step`), to `tensor` (default: a tensor no override names),
    warm-up and cosine decay included. ValueError for a malformed spec."""
    try:
        return _layercast.learning_rate(optimizer, step, tensor or "")
    except Error as error:
        raise ValueError(error.message) from None


def connect(shards: Sequence[str], *, tls: Optional[Mapping[str, str]] = None,
            timeout: float = _DEFAULTS.connect_timeout, worker_token: Optional[str] = None,
            insecure: bool = False) -> ShardSet:
    """Connects to the shard set at `shards` (host:port, in shard order) and
    checks its shards agree. `tls`: {root_certificates, certificate_chain,
    private_key} as PEM strings (mutual TLS with the last two); plaintext
    without. Waits up to `timeout` seconds for shards still starting.
    `worker_token`: this worker's token when the shards were started with
    --worker-token-dir (their worker-<index> file; surrounding whitespace is
    trimmed), sent with its gradient pushes and clip scales; refused without
    `tls` unless `insecure` (loopback testing only)."""
    if isinstance(shards, str):
        shards = [s.strip() for s in shards.split(",") if s.strip()]
    return ShardSet(_layercast.connect(list(shards), dict(tls) if tls is not None else None,
                                       timeout, worker_token or "", insecure))
