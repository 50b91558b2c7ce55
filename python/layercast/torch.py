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

from . import Layer, ShardSet, _layercast, learning_rate

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


class UnboundParameterError(ValueError):
    """A stage used a parameter of the model that no gathered layer binds:
    the message names it and says where the shards hold it, if they do."""


class _Touched(Exception):
    """Raised inside a stage when it uses an unbound parameter (`name`)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _Unbound(torch.Tensor):
    """Stands in, during a stage, for a parameter no gathered layer binds:
    its shape and dtype read as the parameter's, and any computation with
    it raises _Touched naming it, where the meta parameter would have given
    a meta tensor with no values."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "__get__" or func in (torch.Tensor.size,
                                                                  torch.Tensor.dim):
            return super().__torch_function__(func, types, args, kwargs or {})
        stack = list(args) + list((kwargs or {}).values())
        while stack:
            item = stack.pop()
            if isinstance(item, _Unbound):
                raise _Touched(item._layercast_name)
            if isinstance(item, (list, tuple)):
                stack.extend(item)
        raise _Touched("?")


def _unbound(name: str, parameter: torch.Tensor) -> torch.Tensor:
    sentinel = torch.Tensor._make_subclass(_Unbound, torch.empty_like(parameter, device="meta"),
                                           False)
    sentinel._layercast_name = name
    return sentinel


# The modules whose kernels refuse inputs of another floating dtype than
# their weight's ("expected scalar type BFloat16 but found Float"): under a
# policy that keeps some of them in float32 inside a bf16 model, their
# inputs are cast to the weight's dtype, as autocast casts around
# layer_norm and linear. Only where the plain call would fail: a model that
# casts for itself runs as it is.
_CASTING_MODULES = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.Conv1d, torch.nn.Conv2d,
                    torch.nn.Conv3d, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
                    torch.nn.ConvTranspose3d, torch.nn.LayerNorm, torch.nn.GroupNorm)


def _module_params(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Parameter]]:
    """Every (name, parameter) of the model, a tied one under each of its
    names (named_parameters() gives only the first)."""
    found = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for leaf, parameter in module._parameters.items():
            if parameter is not None:
                found.append((f"{prefix}.{leaf}" if prefix else leaf, parameter))
    return found


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
    """The value of each of the 256 codes of an OCP 8-bit float, by code:
    the shards' own table (core/fp8), not a second one."""
    return torch.tensor(_layercast.fp8_values(dtype), dtype=torch.float32)


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

    def set(self) -> None:
        """Makes this the random state, as it was (to run code again)."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)

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
    `timeout`: seconds each gather may take, waiting for the other workers'
    pushes of the step before included (a gather that times out names the
    workers that have not pushed).

    Two loop shapes: `train_step(inputs, targets, loss_fn)` does a whole
    step and overlaps each layer's push with the backward pass below it;
    or, as with a plain PyTorch model, `loss_fn(trainer(inputs),
    targets).backward()` for each micro batch (gradients add up on the
    worker), then `step()`. The learning rate is the shards' schedule
    (--optimizer's lr, warmup_steps, decay_steps, min_lr):
    `learning_rate` reads the next step's back.

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
    The backward pass's recomputation leaves them as they were before it:
    a BatchNorm's running statistics move once per forward pass, as in
    plain PyTorch.

    Tied parameters (`lm_head.weight = wte.weight`) are held once by the
    shards: a stage using the other name gathers the holder's layer too,
    and the gradient is the sum of both uses. A stage that uses a
    parameter no gathered layer binds raises UnboundParameterError naming
    it. A Linear, Conv or LayerNorm whose weight the policy keeps in
    another dtype than its input's gets its input cast, as autocast would.
    """

    def __init__(self, shard_set: ShardSet, model: torch.nn.Module, stages: Sequence[Stage], *,
                 worker: int = 0, budget_bytes: Optional[int] = None, lookahead: int = 1,
                 buffers: Optional[Mapping[str, torch.Tensor]] = None,
                 timeout: float = _layercast.defaults.layer_timeout):
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
        self._nbytes = {layer["index"]: layer["nbytes"] for layer in manifest["layers"]}
        self._layer_names = {layer["index"]: layer["name"] for layer in manifest["layers"]}
        self._served = {tensor["name"]: layer["index"] for layer in manifest["layers"]
                        for tensor in layer["tensors"]}
        self._init_ties()
        # Per stage, the tied parameters it uses that another layer holds
        # (found on its first run), and whether it has run through once.
        self._extras: List[List[str]] = [[] for _ in self.stages]
        self._verified = [False] * len(self.stages)
        self._explicit_budget = budget_bytes
        sizes = sorted((by_name[name]["nbytes"] for name, _ in stages), reverse=True)
        self.budget_bytes = budget_bytes or sum(sizes[:2])
        self.lookahead = lookahead
        self.timeout = timeout
        self.optimizer = manifest["optimizer"]
        self.version = manifest["version"]
        self._compute_dtype, self._output_dtype = _policy_dtypes(manifest["policy"])
        # Per layer index, the gradients backward() added up for step().
        self._grads: Dict[int, Dict[str, torch.Tensor]] = {}
        self.bytes_fetched = 0
        self.bytes_pushed = 0
        self.fetch_seconds = 0.0
        self.push_seconds = 0.0

    def _init_ties(self) -> None:
        """Finds the model's tied parameters (one tensor under several
        names, `lm_head.weight = wte.weight`): the shards hold each once,
        under one of its names (the holder), and every other name (an
        alias) is bound to the holder's gathered tensor. Builds
        self._ties ({alias: (holder's layer index, holder)}), the names'
        stand-ins for stages, and the cast hooks' module names."""
        by_tensor: Dict[int, List[str]] = {}
        self._param_names: List[str] = []
        self._sentinels: Dict[str, torch.Tensor] = {}
        for name, parameter in _module_params(self.model):
            by_tensor.setdefault(id(parameter), []).append(name)
            self._param_names.append(name)
            self._sentinels[name] = _unbound(name, parameter)
        self._ties: Dict[str, Tuple[int, str]] = {}
        for names in by_tensor.values():
            held = [name for name in names if name in self._served]
            if len(held) > 1:
                raise ValueError(
                    f"the model ties {names} (one tensor under {len(names)} names), but the "
                    f"shards hold {held} as separate tensors and would train them apart: write "
                    f"the model with layercast.torch.save_safetensors(model.state_dict()) or "
                    f"dict(model.named_parameters()), which write a tied tensor once")
            if held:
                for alias in names:
                    if alias != held[0]:
                        self._ties[alias] = (self._served[held[0]], held[0])
        self._module_names = {id(module): name for name, module in
                              self.model.named_modules(remove_duplicate=False)}

    def _gathers(self, position: int) -> List[int]:
        """The layers stage `position` runs with: its own, then those that
        hold tied parameters it uses."""
        own = self.stages[position][0]
        return [own] + sorted({self._ties[alias][0] for alias in self._extras[position]} - {own})

    def _used_layers(self) -> List[int]:
        used = [index for index, _ in self.stages]
        return used + sorted({index for position in range(len(self.stages))
                              for index in self._gathers(position)} - set(used))

    def _budget(self) -> int:
        """The stream budget: at least every layer one stage runs with."""
        widest = max(sum(self._nbytes[i] for i in self._gathers(position))
                     for position in range(len(self.stages)))
        if self._explicit_budget is not None and widest > self._explicit_budget:
            raise ValueError(f"budget_bytes={self._explicit_budget} cannot hold the layers one "
                             f"stage runs with (a tied parameter's layer beside its own): "
                             f"{widest} bytes; give at least that")
        return max(self.budget_bytes, widest)

    def _stream(self, indices: List[int]):
        return self.shard_set.stream(indices, self._budget(), lookahead=self.lookahead,
                                     min_version=self.version, timeout=self.timeout)

    def _binding(self, position: int,
                 tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """{model parameter name: tensor} for stage `position` from its
        gathered layers' tensors ({layer index: {tensor name: tensor}}):
        the layer's own, and each tied alias bound to its holder's."""
        own_index = self.stages[position][0]
        binding = dict(tensors[own_index])
        for alias, (index, holder) in self._ties.items():
            if index == own_index:
                binding[alias] = binding[holder]
        for alias in self._extras[position]:
            index, holder = self._ties[alias]
            binding[alias] = tensors[index][holder]
        return binding

    @contextlib.contextmanager
    def _running(self, position: int, binding: Mapping[str, torch.Tensor]):
        """Runs a block as stage `position`: `binding` bound in the model,
        every other parameter a stand-in that raises _Touched when used,
        and inputs cast to a float32 module's weight's dtype (and back)
        as autocast would. A kernel's dtype complaint names the module."""
        unknown = sorted(binding.keys() - self._sentinels.keys())
        if unknown:
            raise KeyError(f"the model has no parameters {unknown[:5]}: name the model's "
                           f"modules as the shards name their tensors")
        entered: List[torch.nn.Module] = []  # the modules whose forward is running

        def left(module, args, output):
            if entered and entered[-1] is module:
                entered.pop()

        def cast_inputs(module, args):
            entered.append(module)
            if not isinstance(module, _CASTING_MODULES):
                return None
            weight = module._parameters.get("weight")
            if weight is None or isinstance(weight, _Unbound):
                return None
            dtype = weight.dtype
            if not any(isinstance(a, torch.Tensor) and a.dtype.is_floating_point and
                       a.dtype != dtype for a in args):
                return None
            return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and
                         a.dtype.is_floating_point else a for a in args)

        weights = {name: binding.get(name, sentinel) for name, sentinel in self._sentinels.items()}
        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(cast_inputs),
                 torch.nn.modules.module.register_module_forward_hook(left)]
        try:
            with bound(self.model, weights):
                yield
        except RuntimeError as error:
            text = str(error)
            if entered and ("expected scalar type" in text or "same dtype" in text):
                module = entered[-1]
                name = self._module_names.get(id(module), type(module).__name__)
                dtypes = sorted({str(p.dtype) for p in module._parameters.values()
                                 if p is not None})
                raise TypeError(
                    f"stage {self._stage_name(position)!r}: module {name!r} "
                    f"({type(module).__name__}, parameters {dtypes}) ran on inputs of another "
                    f"dtype ({text.splitlines()[0]}): cast its input to its parameters' dtype "
                    f"in its forward (as examples/cnn_train.py does around BatchNorm), or keep "
                    f"its tensors in the compute dtype in --policy") from error
            raise
        finally:
            for hook in hooks:
                hook.remove()

    def _stage_name(self, position: int) -> str:
        return self._layer_names[self.stages[position][0]]

    def _unbound_error(self, position: int, name: str) -> UnboundParameterError:
        stage = self._stage_name(position)
        if name in self._served:
            return UnboundParameterError(
                f"stage {stage!r} uses {name}, which the shards serve in layer "
                f"{self._layer_names[self._served[name]]!r}: a stage runs with its own layer's "
                f"tensors only; group the tensors so that the layer holds it "
                f"(--first-layer-prefix, --layer-regex: docs/models.md)")
        return UnboundParameterError(
            f"stage {stage!r} uses the model's parameter {name}, which the shards do not serve "
            f"(it would run as a meta tensor, with no values): serve a model file that holds "
            f"it (layercast.torch.save_safetensors(model.state_dict())), or tie it to one they "
            f"serve as the model does")

    def _run_forward(self, position: int, fn: Callable, x: torch.Tensor,
                     layers: Dict[int, Layer], rng: "_RngState") -> torch.Tensor:
        """Stage `position` on `x` without autograd. On its first run, a
        tied parameter it uses that another layer holds is found when it
        is used: that layer is gathered, the buffers and the random state
        are put back, and the stage runs again; from then on, the stage's
        gathers include that layer."""
        while True:
            before = None
            if not self._verified[position]:
                before = [(buffer, buffer.clone()) for buffer in self.model.buffers()]
            try:
                tensors = {index: layer_weights(layer) for index, layer in layers.items()}
                with self._running(position, self._binding(position, tensors)):
                    output = fn(x)
                self._verified[position] = True
                return output
            except _Touched as touched:
                name = touched.name
                if before is None or name not in self._ties:
                    raise self._unbound_error(position, name) from None
                self._extras[position].append(name)
                index = self._ties[name][0]
                if index not in layers:
                    with self.shard_set.stream([index], self._nbytes[index],
                                               min_version=self.version,
                                               timeout=self.timeout) as stream:
                        layers[index] = self._next(stream)
                with torch.no_grad():
                    for buffer, value in before:
                        buffer.copy_(value)
                rng.set()

    @property
    def learning_rate(self) -> float:
        """The learning rate the shards apply at the next step (to tensors
        no override of their --optimizer names): their schedule, read back
        from the manifest; 0.0 for read-only shards."""
        if not self._trains:
            return 0.0
        return learning_rate(self.optimizer, self.version + 1)

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
        x, _, _ = self._forward(self._input(inputs), saving=False)
        return self._output(x)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """One step: forward, backward with each layer's gradient pushed as
        soon as it is known (while the stages below run), and the step
        finished on the shards (with clipping, worker 0 completes it for
        every worker). Returns the loss. The next step gathers the layers at
        the version this one produced. For gradient accumulation, or a loss
        computed your own way, call the trainer (`trainer(inputs)`), then
        `loss.backward()` and `step()` instead."""
        self._check_trains()
        if self._grads:
            raise RuntimeError("gradients from trainer(inputs) ... backward() are waiting for "
                               "step(): call step() (or zero_grad()) before train_step")
        step = self.version
        x, saved, rng_states = self._forward_saving(inputs)
        del x  # recomputed with autograd, with the loss, in the backward pass
        pushes: list = []
        loss_value: List[float] = []

        def top(output: torch.Tensor) -> None:
            loss = loss_fn(self._output(output), targets)
            loss_value.append(loss.item())
            loss.backward()

        def push(index: int, grads: Dict[str, torch.Tensor]) -> None:
            start = time.perf_counter()
            pushes.append(self.shard_set.push_gradients(step, self.worker, index, grads))
            self.push_seconds += time.perf_counter() - start
            self.bytes_pushed += self._grad_nbytes[index]

        self._backward(saved, rng_states, top, push)
        self._finish(step, pushes)
        return loss_value[0]

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output for `inputs`, as part of autograd's graph:
        `loss.backward()` on anything computed from it runs the backward
        pass through the stages (each layer gathered again and its stage
        recomputed) and adds each layer's weight gradient to the ones kept
        on this worker, as PyTorch adds into .grad (in the compute dtype).
        Call it and backward() for each micro batch (scale the loss as for
        plain PyTorch's accumulation, e.g. by 1/micro_batches), then step().
        Each output's backward must run before the trainer's next step()."""
        self._check_trains()
        anchor = torch.empty(0, requires_grad=True)
        return self._output(_Stages.apply(anchor, self, inputs))

    def step(self) -> None:
        """Pushes the gradients backward() added up since the last step (a
        layer no backward reached pushes zeros), then finishes the step on
        the shards, as train_step does: the next call gathers the version
        it produced."""
        self._check_trains()
        if not self._grads:
            raise RuntimeError("step() with no gradients: run trainer(inputs) and backward() "
                               "on a loss computed from its output first")
        step, pushes = self.version, []
        start = time.perf_counter()
        for index in self._used_layers():
            grads = self._grads.get(index)
            if grads is None:
                grads = {name: torch.zeros(shape, dtype=dtype)
                         for name, (shape, dtype) in self._grad_shapes(index).items()}
            pushes.append(self.shard_set.push_gradients(step, self.worker, index, grads))
            self.bytes_pushed += self._grad_nbytes[index]
        self.push_seconds += time.perf_counter() - start
        self._grads = {}
        self._finish(step, pushes)

    def zero_grad(self) -> None:
        """Drops the gradients backward() added up since the last step."""
        self._grads = {}

    def _check_trains(self) -> None:
        if not self._trains:
            raise ValueError("the shards run no optimizer (started without --optimizer): they "
                             "serve forward() only; train against shards started with "
                             "--optimizer")

    def _grad_shapes(self, index: int) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        layer = next(layer for layer in self.shard_set.manifest["layers"]
                     if layer["index"] == index)
        return {t["name"]: (tuple(t["shape"]), _POLICY_DTYPES[t["grad_dtype"]])
                for t in layer["tensors"]}

    def _finish(self, step: int, pushes: list) -> None:
        start = time.perf_counter()
        for push in pushes:
            push.result()
        self.shard_set.finish_step(step, self.worker)
        self.push_seconds += time.perf_counter() - start
        self.version = step + 1

    def _forward_saving(self, inputs: torch.Tensor):
        """The forward pass without autograd, keeping what the backward
        pass recomputes each stage from: its input and the random state it
        ran with (dropout's masks are drawn again from it, as
        torch.utils.checkpoint does)."""
        x = self._input(inputs)
        if x is inputs:
            # The caller's own tensor: a batch buffer refilled before the
            # backward pass must not change what it recomputes.
            x = x.detach().clone()
        return self._forward(x, saving=True)

    def _forward(self, x: torch.Tensor, saving: bool):
        """Every stage on `x` without autograd; with `saving`, keeps each
        stage's input and random state."""
        saved: List[Optional[torch.Tensor]] = []
        rng_states: List[_RngState] = []
        plan = [self._gathers(position) for position in range(len(self.stages))]
        with torch.no_grad(), self._stream([i for gathers in plan for i in gathers]) as stream:
            for position, (_, fn) in enumerate(self.stages):
                rng = _RngState.now()
                if saving:
                    saved.append(x)
                    rng_states.append(rng)
                layers = {index: self._next(stream) for index in plan[position]}
                x = self._run_forward(position, fn, x, layers, rng)
                del layers
        return x, saved, rng_states

    def _accumulate(self, layers: Dict[int, Dict[str, torch.Tensor]]) -> None:
        """Adds one whole backward pass's gradients to those step() pushes."""
        for index, grads in layers.items():
            held = self._grads.setdefault(index, {})
            for name, grad in grads.items():
                if name in held:
                    held[name] += grad
                else:
                    held[name] = grad

    def _backward(self, saved: List[Optional[torch.Tensor]], rng_states: List["_RngState"],
                  top: Callable[[torch.Tensor], None],
                  on_grads: Callable[[int, Dict[str, torch.Tensor]], None]) -> Optional[torch.Tensor]:
        """Each stage again, last first, with autograd: `top(output)` runs
        the last stage's backward, the gradient of each stage's input runs
        the one below's, and each layer's weight gradient goes to
        `on_grads(layer index, grads)` as soon as it is known. Buffers
        (BatchNorm's running statistics) are left as they were before the
        recomputation, which would move them a second time. Returns the
        gradient of the first stage's input (None for token ids)."""
        before = [(buffer, buffer.clone()) for buffer in self.model.buffers()]
        grad_output: Optional[torch.Tensor] = None
        plan = [(position, self._gathers(position)) for position in reversed(range(len(self.stages)))]
        # A layer's gradient is complete, and handed over, after the last
        # stage (in backward order) that runs with it: a tied parameter's
        # is the sum of its uses' in every stage, as autograd sums them.
        last_use: Dict[int, int] = {}
        for position, gathers in plan:
            for index in gathers:
                last_use[index] = position
        pending: Dict[int, Dict[str, torch.Tensor]] = {}
        try:
            with self._stream([i for _, gathers in plan for i in gathers]) as stream:
                for position, gathers in plan:
                    fn = self.stages[position][1]
                    layers = {index: self._next(stream) for index in gathers}
                    tensors = {index: layer_weights(layer, requires_grad=True)
                               for index, layer in layers.items()}
                    stage_input = saved[position]
                    if stage_input.is_floating_point():
                        stage_input = stage_input.detach().requires_grad_()
                    with torch.enable_grad(), self._running(position,
                                                            self._binding(position, tensors)):
                        # Forked: the run again draws what the forward pass
                        # drew, and leaves the random state where the forward
                        # pass left it, as a plain PyTorch step would.
                        with rng_states[position].restored():
                            output = fn(stage_input)
                        if position == len(self.stages) - 1:
                            top(output)
                        else:
                            output.backward(grad_output)
                    for index, weights in tensors.items():
                        held = pending.setdefault(index, {})
                        for name, tensor in weights.items():
                            if tensor.grad is not None:
                                held[name] = held[name] + tensor.grad if name in held \
                                    else tensor.grad
                    for index in gathers:
                        if last_use[index] == position:
                            held = pending.pop(index)
                            on_grads(index, {name: (held[name] if name in held
                                                    else torch.zeros_like(tensor))
                                             for name, tensor in tensors[index].items()})
                    grad_output = stage_input.grad if stage_input.requires_grad else None
                    # The graph's leaves hold the weights: drop it with them,
                    # so the layers' bytes go back to the stream's budget.
                    del layers, tensors, output
                    saved[position] = None
        except _Touched as touched:
            raise self._unbound_error(position, touched.name) from None
        finally:
            with torch.no_grad():
                for buffer, value in before:
                    buffer.copy_(value)
        return grad_output


class _Stages(torch.autograd.Function):
    """LayerwiseTrainer.__call__ as one node of autograd's graph: forward
    runs the stages without autograd; backward runs the trainer's backward
    pass from the output's gradient and adds up the weights' gradients.
    `anchor` (an empty tensor that requires grad) makes the output require
    grad when the inputs are token ids."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, trainer: "LayerwiseTrainer",
                inputs: torch.Tensor) -> torch.Tensor:
        x, saved, rng_states = trainer._forward_saving(inputs)
        ctx.trainer, ctx.saved, ctx.rng_states = trainer, saved, rng_states
        ctx.version = trainer.version
        return x

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        trainer: LayerwiseTrainer = ctx.trainer
        if ctx.version != trainer.version:
            raise RuntimeError(f"this output was computed at version {ctx.version}, and step() "
                               f"has moved the shards to {trainer.version} since: run backward() "
                               f"on each output before the step that uses its gradients")
        if ctx.saved is None:
            raise RuntimeError("the trainer's backward pass runs once per output (it frees the "
                               "activations it recomputes from): retain_graph cannot run it again")
        saved, ctx.saved = ctx.saved, None
        # Added to the trainer's only once the whole pass is through: a
        # failure midway leaves step() none of its gradients.
        grads: Dict[int, Dict[str, torch.Tensor]] = {}

        def keep(index: int, layer_grads: Dict[str, torch.Tensor]) -> None:
            # Their own memory: the layer's buffer goes back to the stream.
            grads[index] = {name: grad.clone() for name, grad in layer_grads.items()}

        grad_input = trainer._backward(saved, ctx.rng_states,
                                       lambda output: output.backward(grad_output), keep)
        trainer._accumulate(grads)
        return None, None, grad_input


# The safetensors dtype of each torch dtype a shard reads: floats it serves
# (widened exactly to its fp32 master), and integers and booleans it skips
# (buffers such as BatchNorm's num_batches_tracked, position ids, masks).
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def save_safetensors(path, tensors: Dict[str, torch.Tensor],
                     metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes tensors ({name: tensor}, e.g. a model's state_dict()) as a
    safetensors file, a model the shards can serve (--model): float32,
    bfloat16 and float16 tensors are its parameters; integer and boolean ones
    (buffers such as num_batches_tracked) are written too, and the shards
    skip them. Other dtypes (float64, 8-bit floats) are refused: the shards
    cannot serve them. A tensor given under two names (tied weights, as
    state_dict() gives them) is written once, under the first. `metadata`:
    the file's `__metadata__` (strings). Written by the shards' own writer
    (core/safetensors), so the file is laid out as a shard lays out its own;
    a name it refuses (empty, "__metadata__") raises layercast.Error."""
    _layercast.write_safetensors(str(path), _safetensors_entries(tensors), _strings(metadata))


def _strings(metadata: Optional[Mapping[str, str]]) -> Dict[str, str]:
    return {str(key): str(value) for key, value in (metadata or {}).items()}


def _safetensors_entries(tensors: Dict[str, torch.Tensor]) -> list:
    """(name, dtype tag, shape, bytes) of each tensor, as the native writer
    takes them; a tied tensor once, under its first name."""
    entries, written = [], set()
    for name, tensor in tensors.items():
        # A tied tensor (state_dict() of a model with lm_head.weight =
        # wte.weight gives both names, views of one storage) is written once,
        # under its first name: the shards then hold and train one tensor.
        same = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape),
                tensor.stride())
        if tensor.numel() and same in written:
            continue
        written.add(same)
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"{name} is {tensor.dtype}, which the shards cannot serve; convert it "
                            f"to float32 (or bfloat16, float16) first")
        # Its bytes as they lie in memory (little-endian, as the format's),
        # viewed as bytes since numpy has no bfloat16: no copy for a
        # contiguous CPU tensor.
        flat = tensor.detach().contiguous().cpu().reshape(-1)
        entries.append((name, dtype, list(tensor.shape), flat.view(torch.uint8).numpy()))
    return entries


_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


def load_safetensors(path) -> Dict[str, torch.Tensor]:
    """Reads a safetensors model ({name: tensor}, on the CPU): one file, or
    a Hugging Face index ("....safetensors.index.json") and the files it
    names, as `ShardSet.export` writes them; in the order the files hold
    them. The header is the shards' reader's (checked as strictly: a
    malformed file raises layercast.Error naming it and what is wrong); the
    dtypes are save_safetensors's."""
    import pathlib

    entries, _ = _layercast.safetensors_header(str(path))
    tensors: Dict[str, torch.Tensor] = {}
    # One file's bytes at a time (the entries come file by file): a split
    # model never sits in memory twice.
    held, data = None, b""
    for name, tag, shape, file, begin, nbytes in sorted(entries, key=lambda e: (e[3], e[4])):
        dtype = _TORCH_DTYPES.get(tag)
        if dtype is None:
            raise TypeError(f"{path}: tensor {name} is {tag}, which this reader does not take; "
                            f"it reads {sorted(_TORCH_DTYPES)}")
        if file != held:
            held, data = file, b""  # the previous file's bytes go first
            data = pathlib.Path(file).read_bytes()
        raw = bytearray(data[begin:begin + nbytes])
        tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape) if raw else \
            torch.empty(shape, dtype=dtype)
    return tensors


# The optimizer's state in and out of torch.optim (after the functions it uses).
from .training_state import (export_checkpoint, load_optimizer_state,  # noqa: E402,F401
                             save_optimizer_state)
