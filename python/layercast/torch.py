"""Run a PyTorch model whose parameters live on layercast shards.

The model is built on the `meta` device: the worker holds no weights. It is
cut into stages, one per layercast layer, each a callable from activations to
activations that uses the model's modules. Each stage's weights are gathered
just before it runs, in the compute dtype the shards cast them to (bf16, with
the policy's exceptions), bound to the model's parameters without a copy
(DLPack), and dropped after it.

Training (`LayerwiseTrainer.train_step`) runs the forward pass without
autograd, keeping each stage's input, then walks the stages backwards: it
gathers each layer again, recomputes the stage with autograd, back-propagates
the gradient of its output, and pushes the gradient of the layer's weights to
the shards as soon as that stage is done, while the stages below run. The
shards average the W workers' gradients in fp32 and step the optimizer on the
fp32 master. Recomputing a stage repeats the same kernels on the same inputs
with the random state of its forward run (dropout draws the same masks), so
on the CPU the result is bit for bit what one autograd graph through the
whole model gives (the Python package's tests check it against plain
PyTorch with an fp32 master and a bf16 compute copy).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from . import Layer, ShardSet

Stage = Tuple[str, Callable[[torch.Tensor], torch.Tensor]]


@contextlib.contextmanager
def bound(model: torch.nn.Module, weights: Dict[str, torch.Tensor]) -> Iterator[None]:
    """Binds `weights` ({parameter name: tensor}) in place of the model's
    parameters of those names for the duration of the block, then puts the
    (meta) parameters back: what torch.func.functional_call does, for torch
    versions without it."""
    saved = []
    try:
        for name, tensor in weights.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if leaf not in owner._parameters:
                raise KeyError(f"the model has no parameter {name}: name the model's modules "
                               f"as the shards name their tensors")
            saved.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = tensor
        yield
    finally:
        for owner, leaf, parameter in reversed(saved):
            owner._parameters[leaf] = parameter


def _place_buffers(model: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Puts `buffers` in `model` by name; a ValueError naming any buffer
    still on the meta device, a KeyError naming any the model lacks."""
    names = {name for name, _ in model.named_buffers()}
    unknown = sorted(set(buffers) - names)
    if unknown:
        raise KeyError(f"the model has no buffers {unknown}; its buffers are {sorted(names)}")
    for name, tensor in buffers.items():
        owner_name, _, leaf = name.rpartition(".")
        model.get_submodule(owner_name)._buffers[leaf] = tensor
    on_meta = sorted(name for name, buffer in model.named_buffers() if buffer.is_meta)
    if on_meta:
        raise ValueError(f"the model's buffers {on_meta} are on the meta device, with no values "
                         f"to run with; give them as buffers=, e.g. "
                         f"buffers=dict(model_built_on_cpu.named_buffers())")


def _fp8_values(dtype: str) -> torch.Tensor:
    """The value of each of the 256 codes of an OCP 8-bit float, by code."""
    exponent_bits, mantissa_bits = {"float8_e4m3fn": (4, 3), "float8_e5m2": (5, 2)}[dtype]
    bias = (1 << (exponent_bits - 1)) - 1
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
        mantissa = code & ((1 << mantissa_bits) - 1)
        top = exponent == (1 << exponent_bits) - 1
        if dtype == "float8_e4m3fn" and top and mantissa == (1 << mantissa_bits) - 1:
            values.append(float("nan"))  # e4m3fn has no infinities, one NaN
        elif dtype == "float8_e5m2" and top:
            values.append(sign * float("inf") if mantissa == 0 else float("nan"))
        elif exponent == 0:
            values.append(sign * mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias))
        else:
            values.append(sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias))
    return torch.tensor(values, dtype=torch.float32)


def dequantize(tensor) -> torch.Tensor:
    """An 8-bit float layercast Tensor's values as a new float32 torch tensor:
    value(code[i]) * scales[i // block_size], each product rounded to float32
    as the shards define it. Other tensors come back as float32 copies."""
    if not tensor.block_size:
        return torch.from_dlpack(tensor).to(torch.float32, copy=True)
    codes = torch.from_dlpack(tensor).reshape(-1).long()
    scales = torch.from_dlpack(tensor.scales)
    values = _fp8_values(tensor.dtype)[codes]
    per_element = scales.repeat_interleave(tensor.block_size)[: values.numel()]
    return (values * per_element).reshape(tensor.shape)


def layer_weights(layer: Layer, requires_grad: bool = False) -> Dict[str, torch.Tensor]:
    """The layer's tensors as torch tensors viewing its buffer (no copy), but
    8-bit float tensors, which torch here cannot compute with: those are
    dequantized into float32 copies."""
    weights = {}
    for name, view in layer.tensors.items():
        tensor = dequantize(view) if view.block_size else torch.from_dlpack(view)
        weights[name] = tensor.requires_grad_() if requires_grad else tensor
    return weights


class _RngState:
    """Torch's random state (CPU, and every CUDA device once CUDA is in
    use) at one point, to run code again with the same draws."""

    def __init__(self, cpu: torch.Tensor, cuda: Optional[List[torch.Tensor]]):
        self.cpu = cpu
        self.cuda = cuda

    @classmethod
    def now(cls) -> "_RngState":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def restored(self):
        devices = list(range(len(self.cuda))) if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            yield


_POLICY_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}


def _policy_dtypes(policy: str) -> Tuple[Optional[torch.dtype], Optional[torch.dtype]]:
    """The policy's compute and output dtypes (its default part, before the
    per-tensor rules); None for an 8-bit float compute dtype, whose layers
    run dequantized."""
    default = dict(item.split("=", 1) for item in policy.split(";")[0].split(",") if "=" in item)
    return _POLICY_DTYPES.get(default.get("compute", "")), _POLICY_DTYPES.get(
        default.get("output", ""))


class LayerwiseTrainer:
    """Runs `stages` of `model` with weights gathered from `shard_set`, and
    trains it through the shards as worker `worker` of their
    --data-parallel-workers.

    `stages`: [(layer name, fn)], in forward order, one per layercast layer
    the model uses; fn(activations) -> activations. The last stage's output
    goes to the loss. `budget_bytes`: host memory for gathered layers
    (default: the two largest layers, so one gathers while one runs).

    As the shards' precision policy says (jmp's convention): floating-point
    inputs are cast to its compute dtype before the first stage (token ids
    pass as they are), and the last stage's output to its output dtype
    before it is returned or goes to the loss.

    Buffers (BatchNorm's running statistics, a rotary embedding's
    `inv_freq`, masks) live with the worker, never on the shards: each
    worker keeps its own, as DistributedDataParallel does without
    broadcast_buffers. A model built on the meta device has none to run
    with: give them as `buffers` ({name: tensor}, e.g.
    `dict(model_built_on_cpu.named_buffers())`), and they are put in the
    model as given (the model's own buffers off the meta device stay).
    The backward pass's recomputation leaves them as the forward pass left
    them: a BatchNorm's running statistics move once per step, as in plain
    PyTorch.
    """

    def __init__(self, shard_set: ShardSet, model: torch.nn.Module, stages: Sequence[Stage], *,
                 worker: int = 0, budget_bytes: Optional[int] = None, lookahead: int = 1,
                 buffers: Optional[Mapping[str, torch.Tensor]] = None):
        self.shard_set = shard_set
        self.model = model
        self.worker = worker
        _place_buffers(model, buffers or {})
        manifest = shard_set.manifest
        # Said now, not after a whole forward and backward pass (the first
        # push's refusal) or a minute waiting for workers that never come.
        # Read-only shards serve forward() alone (train_step refuses).
        self._trains = bool(manifest["optimizer"])
        workers = manifest["data_parallel_workers"]
        if self._trains and not 0 <= worker < workers:
            raise ValueError(f"worker {worker} is not one of the {workers} the shards expect "
                             f"(--data-parallel-workers {workers}): use 0 to {workers - 1}")
        by_name = {layer["name"]: layer for layer in manifest["layers"]}
        self.stages: List[Tuple[int, Callable]] = []
        for position, (name, fn) in enumerate(stages):
            if name not in by_name:
                raise KeyError(f"the shards serve no layer {name!r}; they serve "
                               f"{sorted(by_name)}")
            if any(name == earlier for earlier, _ in stages[:position]):
                # Its gradient would be pushed twice for one step: the first
                # push would count as the whole step's and the second be
                # refused.
                raise ValueError(f"layer {name!r} is listed twice in stages; list each layer "
                                 f"once, with one fn that does all it does")
            self.stages.append((by_name[name]["index"], fn))
        self._grad_nbytes = {layer["index"]: layer["grad_nbytes"] for layer in manifest["layers"]}
        sizes = sorted((by_name[name]["nbytes"] for name, _ in stages), reverse=True)
        self.budget_bytes = budget_bytes or sum(sizes[:2])
        self.lookahead = lookahead
        self.version = manifest["version"]
        self._compute_dtype, self._output_dtype = _policy_dtypes(manifest["policy"])
        self.bytes_fetched = 0
        self.bytes_pushed = 0
        self.fetch_seconds = 0.0
        self.push_seconds = 0.0

    def _stream(self, indices: List[int]):
        return self.shard_set.stream(indices, self.budget_bytes, lookahead=self.lookahead,
                                     min_version=self.version)

    def _input(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.is_floating_point() and self._compute_dtype is not None:
            return inputs.to(self._compute_dtype)
        return inputs

    def _output(self, outputs: torch.Tensor) -> torch.Tensor:
        if outputs.is_floating_point() and self._output_dtype is not None:
            return outputs.to(self._output_dtype)
        return outputs

    def _next(self, stream) -> Layer:
        start = time.perf_counter()
        layer = next(stream)
        self.fetch_seconds += time.perf_counter() - start
        self.bytes_fetched += layer.nbytes
        return layer

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output for `inputs` at the shards' current version."""
        x = self._input(inputs)
        with self._stream([index for index, _ in self.stages]) as stream:
            for _, fn in self.stages:
                layer = self._next(stream)
                with bound(self.model, layer_weights(layer)):
                    x = fn(x)
                del layer
        return self._output(x)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """One step: forward, backward with each layer's gradient pushed as
        soon as it is known, and the step finished on the shards (with
        clipping, worker 0 completes it for every worker). Returns the loss.
        The next step gathers the layers at the version this one produced."""
        if not self._trains:
            raise ValueError("the shards run no optimizer (started without --optimizer): they "
                             "serve forward() only; train against shards started with "
                             "--optimizer")
        step = self.version
        saved: List[torch.Tensor] = []
        # The random state each stage ran its forward pass with: the
        # backward pass runs the stage again with the same (dropout's masks),
        # as torch.utils.checkpoint does, so the gradients are those of the
        # forward pass that gave the loss.
        rng_states: List[_RngState] = []
        x = self._input(inputs)
        with torch.no_grad(), self._stream([index for index, _ in self.stages]) as stream:
            for _, fn in self.stages:
                saved.append(x)
                rng_states.append(_RngState.now())
                layer = self._next(stream)
                with bound(self.model, layer_weights(layer)):
                    x = fn(x)
                del layer
        # What the forward pass left in the buffers, put back after the
        # recomputation (which moves a BatchNorm's running statistics again).
        after_forward = [(buffer, buffer.clone()) for buffer in self.model.buffers()]
        pushes: list = []
        try:
            loss_value = self._backward(saved, rng_states, targets, loss_fn, step, pushes)
        finally:
            with torch.no_grad():
                for buffer, forward_value in after_forward:
                    buffer.copy_(forward_value)
        start = time.perf_counter()
        for push in pushes:
            push.result()
        self.shard_set.finish_step(step, self.worker)
        self.push_seconds += time.perf_counter() - start
        self.version = step + 1
        return loss_value

    def _backward(self, saved: List[Optional[torch.Tensor]], rng_states: List["_RngState"],
                  targets: torch.Tensor, loss_fn, step: int, pushes: list) -> float:
        """train_step's backward pass: each stage again, with autograd, its
        layer's gradient pushed (into `pushes`) as soon as it is known.
        Returns the loss."""
        loss_value = None
        grad_output: Optional[torch.Tensor] = None
        with self._stream([index for index, _ in reversed(self.stages)]) as stream:
            for position in reversed(range(len(self.stages))):
                index, fn = self.stages[position]
                layer = self._next(stream)
                weights = layer_weights(layer, requires_grad=True)
                stage_input = saved[position]
                if stage_input.is_floating_point():
                    stage_input = stage_input.detach().requires_grad_()
                with bound(self.model, weights):
                    # Forked: the run again draws what the forward pass drew,
                    # and leaves the random state where the forward pass left
                    # it, as a plain PyTorch step would.
                    with rng_states[position].restored():
                        output = fn(stage_input)
                    if position == len(self.stages) - 1:
                        output = loss_fn(self._output(output), targets)
                        loss_value = output.item()
                        output.backward()
                    else:
                        output.backward(grad_output)
                grads = {}
                for name, tensor in weights.items():
                    grads[name] = (tensor.grad if tensor.grad is not None
                                   else torch.zeros_like(tensor))
                start = time.perf_counter()
                pushes.append(self.shard_set.push_gradients(step, self.worker, index, grads))
                self.push_seconds += time.perf_counter() - start
                self.bytes_pushed += self._grad_nbytes[index]
                grad_output = stage_input.grad if stage_input.requires_grad else None
                # The graph's leaves hold the weights: drop it with them, so
                # the layer's bytes go back to the stream's budget.
                del layer, weights, grads, output
                saved[position] = None
        return loss_value


# The safetensors dtype of each torch dtype a shard reads: floats it serves
# (widened exactly to its fp32 master), and integers and booleans it skips
# (buffers such as BatchNorm's num_batches_tracked, position ids, masks).
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def save_safetensors(path, tensors: Dict[str, torch.Tensor]) -> None:
    """Writes tensors ({name: tensor}, e.g. a model's state_dict()) as a
    safetensors file, a model the shards can serve (--model): float32,
    bfloat16 and float16 tensors are its parameters; integer and boolean ones
    (buffers such as num_batches_tracked) are written too, and the shards
    skip them. Other dtypes (float64, 8-bit floats) are refused: the shards
    cannot serve them. By hand, since the format is small (an 8-byte header
    length, a JSON header, the raw little-endian bytes) and Debian ships no
    safetensors package."""
    import json

    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"{name} is {tensor.dtype}, which the shards cannot serve; convert it "
                            f"to float32 (or bfloat16, float16) first")
        flat = tensor.detach().contiguous().cpu().reshape(-1)
        # Through bytes of the same width: numpy has no bfloat16.
        if tensor.dtype in (torch.bfloat16, torch.float16):
            flat = flat.view(torch.int16)
        data = flat.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape),
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
