"""The optimizer's state in and out of torch.optim, by parameter name.

A file of torch.optim's state_dict() layout, keyed by parameter names
instead of indices, as safetensors (one file, or several and an index):

    state.<name>.exp_avg, state.<name>.exp_avg_sq  AdamW's, the parameter's shape
    state.<name>.momentum_buffer                   SGD's (with momentum)
    state.<name>.step                              float32, shape [] (torch's step)

with the param groups in its `__metadata__` ("param_groups": torch's, as
JSON, parameters by name; "optimizer": the same hyper-parameters as a
layercast optimizer spec). A parameter torch holds no state for yet is
written as zeros at step 0. Shards start training from it with
`--optimizer-state`; `export_checkpoint` writes one from the checkpoints
shards wrote, and `load_optimizer_state` takes it back into torch.optim.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import pathlib
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import _layercast, learning_rate
from .torch import _safetensors_entries, _strings, load_safetensors

FORMAT = "torch-optimizer-state"
# The hyper-parameters each kind's param group holds that the shards take.
_HYPER_KEYS = {"adamw": ("lr", "betas", "eps", "weight_decay"),
               "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov")}
# Characters a parameter name cannot have in an optimizer spec.
_SPEC_SYNTAX = re.compile(r"[;,:=\s]")


def _kind(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.AdamW):
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("AdamW with amsgrad or maximize: the shards' AdamW has neither")
        return "adamw"
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group.get("dampening") or group.get("maximize"):
                raise ValueError("SGD with dampening or maximize: the shards' SGD has neither")
        return "sgd"
    raise TypeError(f"{type(optimizer).__name__}: the shards run torch.optim.AdamW and SGD only")


def _names(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> List[str]:
    """Each of the optimizer's parameters' name in `module`, in the order
    state_dict() numbers them (a tied parameter by its first name)."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that "
                                 f"is not one of the module's: pass the module it optimizes")
            names.append(by_id[id(p)])
    return names


def _glob_quote(name: str) -> str:
    """A glob that matches exactly `name`: its glob characters as classes."""
    return re.sub(r"([][*?])", r"[\1]", name)


def _number(value) -> str:
    # repr: the shortest text that reads back as the same double.
    return repr(float(value))


def _spec_pairs(kind: str, group: Mapping[str, object]) -> str:
    pairs = [f"lr={_number(group['lr'])}", f"weight_decay={_number(group['weight_decay'])}"]
    if kind == "adamw":
        beta1, beta2 = group["betas"]
        pairs += [f"beta1={_number(beta1)}", f"beta2={_number(beta2)}",
                  f"eps={_number(group['eps'])}"]
    else:
        pairs += [f"momentum={_number(group['momentum'])}",
                  f"nesterov={1 if group['nesterov'] else 0}"]
    return ",".join(pairs)


def _group_json(kind: str, group: Mapping[str, object], names: Sequence[str]) -> Dict[str, object]:
    out = {key: (list(group[key]) if key == "betas" else group[key])
           for key in _HYPER_KEYS[kind] if key in group}
    out["params"] = list(names)
    return out


def _metadata(path: pathlib.Path) -> Dict[str, str]:
    """The `__metadata__` of a safetensors file (of an index's first file),
    its header checked by the shards' reader."""
    return _layercast.safetensors_header(str(path))[1]


def _write(path: pathlib.Path, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str],
           max_file_bytes: int) -> List[str]:
    """One file, or (over max_file_bytes) files and an index, split by the
    native rule ShardSet.export splits by; every file carries `metadata`."""
    return _layercast.write_safetensors_split(str(path), _safetensors_entries(tensors),
                                              _strings(metadata), max_file_bytes)


def _target(path) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.name.endswith(".safetensors"):
        raise ValueError(f"path {str(path)!r} does not end in .safetensors: name the file, "
                         f"e.g. 'optimizer.safetensors'")
    return path


def save_optimizer_state(path, optimizer: torch.optim.Optimizer, module: torch.nn.Module, *,
                         steps: Optional[int] = None,
                         max_file_bytes: int = 5_000_000_000) -> List[str]:
    """Writes `optimizer`'s state (a torch.optim.AdamW or SGD over
    `module`'s parameters) by parameter name, for shards started with
    `--optimizer-state` (and `--model` holding the module's parameters, as
    save_safetensors writes them). `steps`: SGD only, the steps taken so
    far, which torch's SGD does not count (the shards' layers start at that
    version, so a schedule goes on; default: 1 for a parameter with a
    momentum buffer). `path` ends in ".safetensors"; over `max_file_bytes`
    it is split, with "<path>.index.json" (name that to the shards).
    Returns the files written."""
    path = _target(path)
    kind = _kind(optimizer)
    if steps is not None and (kind == "adamw" or steps < 1):
        raise ValueError("steps is for SGD, whose state does not count them, and at least 1; "
                         "AdamW's state holds its own")
    names = _names(optimizer, module)
    for name in names:
        if _SPEC_SYNTAX.search(name):
            raise ValueError(f"parameter name {name!r} holds one of ';,:=' or a space, which an "
                             f"optimizer spec cannot name")
    tensors: Dict[str, torch.Tensor] = {}
    groups, spec = [], ""
    at = 0
    for g, group in enumerate(optimizer.param_groups):
        members = names[at:at + len(group["params"])]
        at += len(members)
        groups.append(_group_json(kind, group, members))
        pairs = _spec_pairs(kind, group)
        if g == 0:
            spec = f"{kind}:{pairs}"
        else:
            # Each parameter of a later group by its own name, glob
            # characters quoted, as the first override that matches wins.
            spec += "".join(f";{_glob_quote(name)}:{pairs}" for name in members)
        for name, p in zip(members, group["params"]):
            state = optimizer.state.get(p, {})
            step = state.get("step", 0)
            buffers = (("exp_avg", "exp_avg_sq") if kind == "adamw" else
                       ("momentum_buffer",) if group["momentum"] else ())
            for buffer in buffers:
                value = state.get(buffer)
                tensors[f"state.{name}.{buffer}"] = (
                    torch.zeros(p.shape, dtype=torch.float32) if value is None else
                    value.detach().to(device="cpu", dtype=torch.float32).contiguous())
            if kind == "sgd" and not group["momentum"]:
                # Plain SGD keeps no state at all: only steps= says how far
                # it went (the shards' lr schedule goes on from there).
                step = steps or 0
            elif kind == "sgd":
                # Without a buffer, no step was taken; with one, the shards
                # count one unless told.
                step = 0 if state.get("momentum_buffer") is None else steps
            if step is not None:
                tensors[f"state.{name}.step"] = torch.tensor(float(step), dtype=torch.float32)
    metadata = {"format": FORMAT, "optimizer": spec, "param_groups": json.dumps(groups)}
    return _write(path, tensors, metadata, max_file_bytes)


def load_optimizer_state(path, optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> None:
    """Loads a state file (save_optimizer_state's or export_checkpoint's)
    into `optimizer`, a torch.optim.AdamW or SGD over `module`'s parameters,
    by name: every parameter's state, and its param group's
    hyper-parameters from the file's (lr, betas, eps, weight_decay;
    momentum, dampening, nesterov), the optimizer's other settings (foreach,
    ...) kept. Each of the optimizer's param groups must hold parameters the
    file gives the same hyper-parameters. torch then steps on as it would
    have. ValueError for a file of another optimizer or model."""
    path = pathlib.Path(path)
    metadata = _metadata(path)
    if metadata.get("format") != FORMAT or "param_groups" not in metadata:
        raise ValueError(f"{path} is not an optimizer state (its __metadata__ lacks format "
                         f"{FORMAT!r}): write it with save_optimizer_state or export_checkpoint")
    kind = _kind(optimizer)
    file_kind = metadata.get("optimizer", "").partition(":")[0]
    if file_kind != kind:
        raise ValueError(f"{path} holds {file_kind} state; the optimizer is {kind}")
    groups = json.loads(metadata["param_groups"])
    group_of = {name: group for group in groups for name in group["params"]}
    tensors = load_safetensors(path)
    names = _names(optimizer, module)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    for i, name in enumerate(names):
        if name not in group_of:
            raise ValueError(f"{path} holds no state for parameter {name}: it is another model's")
        step = tensors.get(f"state.{name}.step")
        if step is not None and float(step) == 0:
            continue  # as torch before a parameter's first step: no state
        try:
            if kind == "adamw":
                state[i] = {"step": step.reshape(()).to(torch.float32).clone(),
                            "exp_avg": tensors[f"state.{name}.exp_avg"],
                            "exp_avg_sq": tensors[f"state.{name}.exp_avg_sq"]}
            elif f"state.{name}.momentum_buffer" in tensors:
                state[i] = {"momentum_buffer": tensors[f"state.{name}.momentum_buffer"]}
        except (KeyError, AttributeError):
            raise ValueError(f"{path} lacks part of parameter {name}'s state (its step, exp_avg "
                             f"and exp_avg_sq)") from None
        for buffer, value in state.get(i, {}).items():
            if buffer != "step" and value.shape != params[i].shape:
                raise ValueError(f"{path}: {name}'s {buffer} is {tuple(value.shape)}, the "
                                 f"parameter {tuple(params[i].shape)}: it is another model's")
    current = optimizer.state_dict()
    param_groups = []
    at = 0
    for g, group in enumerate(current["param_groups"]):
        members = names[at:at + len(group["params"])]
        at += len(members)
        hypers = {json.dumps({k: group_of[n].get(k) for k in _HYPER_KEYS[kind]}) for n in members}
        if len(hypers) > 1:
            raise ValueError(f"param group {g} of the optimizer holds parameters the file gives "
                             f"different hyper-parameters: group them as the file's param_groups")
        taken = {k: v for k, v in (group_of[members[0]].items() if members else ())
                 if k in _HYPER_KEYS[kind]}
        if "betas" in taken:
            taken["betas"] = tuple(taken["betas"])
        param_groups.append({**group, **taken})
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def _spec_hyper(spec: str, name: str) -> Dict[str, float]:
    """Tensor `name`'s hyper-parameters under a layercast optimizer spec
    (core/optimizer_spec.h): the first part, else the first override whose
    glob matches the whole name."""
    parts = spec.split(";")
    kind, _, first = parts[0].partition(":")
    pairs = lambda text: dict(kv.split("=", 1) for kv in text.split(",") if kv)  # noqa: E731
    hyper = {"weight_decay": "0.01" if kind == "adamw" else "0", "beta1": "0.9",
             "beta2": "0.999", "eps": "1e-8", "momentum": "0", "nesterov": "0",
             **pairs(first)}
    for part in parts[1:]:
        glob, _, keys = part.rpartition(":")
        if fnmatch.fnmatchcase(name, glob):
            hyper.update(pairs(keys))
            break
    return {key: (value in ("1", "true") if key == "nesterov" else float(value))
            for key, value in hyper.items()
            if key in ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "nesterov")}


def _checkpoint_files(directory: pathlib.Path, num_shards: Optional[int]) -> List[pathlib.Path]:
    """The files of one shard count's complete checkpoint, in shard order:
    `num_shards`', else the newest complete one's."""
    counts: Dict[int, Dict[int, pathlib.Path]] = {}
    for file in directory.glob("shard-*-of-*.safetensors"):
        match = re.fullmatch(r"shard-(\d+)-of-(\d+)\.safetensors", file.name)
        if match:
            counts.setdefault(int(match[2]), {})[int(match[1])] = file
    complete = {n: [files[i] for i in range(n)] for n, files in counts.items()
                if all(i in files for i in range(n))}
    if num_shards is not None:
        if num_shards not in complete:
            raise ValueError(f"{directory} holds no complete checkpoint of {num_shards} shards "
                             f"(complete: {sorted(complete) or 'none'})")
        return complete[num_shards]
    if not complete:
        raise ValueError(f"{directory} holds no complete checkpoint (shard-<i>-of-<N>."
                         f"safetensors for every i): write one (`layercast checkpoint`, or stop "
                         f"the shards with SIGTERM)")
    return max(complete.values(), key=lambda files: max(f.stat().st_mtime_ns for f in files))


def _read_checkpoint(file: pathlib.Path) -> Tuple[Dict[str, str], Dict[str, torch.Tensor]]:
    # The header as the shards' reader checks it; the checksum over the data.
    entries, metadata = _layercast.safetensors_header(str(file))
    if metadata.get("format") != "layercast-shard-checkpoint":
        raise ValueError(f"{file} is not a layercast shard checkpoint")
    data = file.read_bytes()
    body = memoryview(data)[8 + int.from_bytes(data[:8], "little"):]
    if metadata.get("checksum") != "sha256:" + hashlib.sha256(body).hexdigest():
        raise ValueError(f"{file} is damaged: its data does not match its checksum")
    tensors = {}
    for name, tag, _, _, begin, nbytes in entries:
        if tag != "F32":
            raise ValueError(f"{file}: tensor {name} is {tag}; a shard checkpoint holds F32 only")
        tensors[name] = torch.frombuffer(bytearray(data[begin:begin + nbytes]),
                                         dtype=torch.float32) if nbytes else torch.empty(0)
    return metadata, tensors


def export_checkpoint(checkpoint_dir, directory, module: torch.nn.Module, *,
                      num_shards: Optional[int] = None,
                      max_file_bytes: int = 5_000_000_000) -> Dict[str, object]:
    """Writes what training shards' checkpoint in `checkpoint_dir` holds
    (the files of N shards, N `num_shards` or the newest complete set's) as
    plain PyTorch's: `directory`/model.safetensors, the fp32 master named and
    shaped as `module`'s state_dict() (a `meta` module will do), and beside
    it optimizer.safetensors, the optimizer's state by parameter name for
    load_optimizer_state (or shards' --optimizer-state), its param groups
    the shards' --optimizer's, each lr the one the next step would apply.
    The checkpoint must be at a step boundary (as SIGTERM leaves it, or a
    `layercast checkpoint` between steps). Checks every file's checksum.
    Returns {version, step, files}."""
    files = _checkpoint_files(pathlib.Path(checkpoint_dir), num_shards)
    read = [_read_checkpoint(file) for file in files]
    first = read[0][0]
    for file, (metadata, _) in zip(files, read):
        for key in ("model_id", "version", "optimizer", "optimizer_steps", "layout_digest"):
            if metadata.get(key) != first.get(key):
                raise ValueError(f"{file} has {key} {metadata.get(key)!r}, {files[0]} "
                                 f"{first.get(key)!r}: they are not one checkpoint")
        if metadata.get("staged_pushes"):
            raise ValueError(f"{file} holds pushes of a step not yet applied: checkpoint at a "
                             f"step boundary (after every worker's step) and export that")
    if "optimizer" not in first:
        raise ValueError(f"{files[0]} holds no optimizer state: it is a read-only shard's")
    steps = set(first["optimizer_steps"].split(","))
    if len(steps) != 1:
        raise ValueError(f"{files[0]}: its layers are at different steps ({sorted(steps)}): "
                         f"checkpoint at a step boundary and export that")
    step = int(steps.pop())
    spec = first["optimizer"]
    kind = spec.partition(":")[0]

    def whole(name: str, shape) -> torch.Tensor:
        pieces = [tensors[name] for _, tensors in read if name in tensors]
        if len(pieces) != len(read):
            raise ValueError(f"the checkpoint lacks {name} in some of its files")
        value = torch.cat(pieces)
        if value.numel() != torch.Size(shape).numel():
            raise ValueError(f"the checkpoint's {name} holds {value.numel()} values; the "
                             f"module's is {tuple(shape)}: pass the module it trained")
        return value.reshape(shape)

    shapes = {name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items()}
    held = [name for name in read[0][1] if not name.startswith("__")]
    missing = [name for name in held if name not in shapes]
    if missing:
        raise ValueError(f"the checkpoint holds {missing[0]}, which the module lacks: pass the "
                         f"module it trained")
    master = {name: whole(name, shapes[name]) for name in held}
    parameters = [name for name, _ in module.named_parameters()]
    unheld = [name for name in parameters if name not in master]
    if unheld:
        raise ValueError(f"the checkpoint lacks parameter {unheld[0]}: pass the module it trained")

    tensors: Dict[str, torch.Tensor] = {}
    groups: List[Dict[str, object]] = []
    group_of: Dict[str, int] = {}
    for name in parameters:
        hyper = _spec_hyper(spec, name)
        buffers = (("exp_avg", "exp_avg_sq") if kind == "adamw" else
                   ("momentum_buffer",) if hyper["momentum"] else ())
        for buffer in buffers:
            tensors[f"state.{name}.{buffer}"] = whole(f"__optimizer__/{buffer}/{name}",
                                                      shapes[name])
        tensors[f"state.{name}.step"] = torch.tensor(float(step), dtype=torch.float32)
        group = {"lr": learning_rate(spec, step + 1, name), "weight_decay": hyper["weight_decay"]}
        if kind == "adamw":
            group.update(betas=[hyper["beta1"], hyper["beta2"]], eps=hyper["eps"])
        else:
            group.update(momentum=hyper["momentum"], dampening=0.0, nesterov=hyper["nesterov"])
        key = json.dumps(group, sort_keys=True)
        if key not in group_of:
            group_of[key] = len(groups)
            groups.append({**group, "params": []})
        groups[group_of[key]]["params"].append(name)

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = _write(out / "model.safetensors", master, {}, max_file_bytes)
    written += _write(out / "optimizer.safetensors", tensors,
                      {"format": FORMAT, "optimizer": spec, "param_groups": json.dumps(groups)},
                      max_file_bytes)
    return {"version": int(first["version"]), "step": step, "files": written}
