"""Checks layercast's optimizer steps against torch.optim bit for bit.

Usage: optimizer_torch_test.py FILE, where FILE is what
tests/core/optimizer_torch_test.cc writes (its layout is described there).
For each configuration, every tensor becomes its own param group of
torch.optim.SGD / torch.optim.AdamW (foreach=False) with that tensor's
hyper-parameters; before each step every group's lr is set to the value the
C++ used, then p.grad is set and step() runs on CPU fp32. After every step the
parameters and the optimizer state must have the same bits as the C++'s
(any NaN equals any NaN). Then ClipScale's results must equal
clip_grad_norm_'s coefficient. Exits 1 and lists the first mismatches if any.
"""

import struct
import sys

import torch


class Reader:
    def __init__(self, path):
        self.data = bytearray(open(path, "rb").read())
        self.offset = 0

    def unpack(self, fmt):
        values = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values

    def floats(self, count):
        t = torch.frombuffer(self.data, dtype=torch.float32, count=count, offset=self.offset)
        self.offset += 4 * count
        return t


def bits(t):
    return t.contiguous().view(torch.int32)


def mismatches(got, want):
    both_nan = torch.isnan(got) & torch.isnan(want)
    return ((bits(got) != bits(want)) & ~both_nan).nonzero().flatten()


def describe(value):
    b = struct.unpack("<I", struct.pack("<f", value))[0]
    return f"0x{b:08x} ({value!r})"


def main(path):
    # At least two threads, so torch splits the largest tensor (over its
    # 32768-element grain) and a loop's scalar tail also runs mid-tensor.
    torch.set_num_threads(max(2, torch.get_num_threads()))
    r = Reader(path)
    tensors, steps, configs = r.unpack("QQQ")
    sizes = r.unpack("Q" * tensors)
    total = sum(sizes)
    initial = r.floats(total)
    grads = [r.floats(total) for _ in range(steps)]
    failed = 0
    shown = 0

    for _ in range(configs):
        (length,) = r.unpack("Q")
        spec = bytes(r.data[r.offset:r.offset + length]).decode()
        r.offset += length
        (kind,) = r.unpack("Q")
        hypers = [r.unpack("dddddd") for _ in range(tensors)]
        lrs = [r.unpack("d" * tensors) for _ in range(steps)]
        params = [p.clone() for p in initial.split(sizes)]
        for p in params:
            p.requires_grad_(True)
        groups = []
        for p, (weight_decay, momentum, nesterov, beta1, beta2, eps) in zip(params, hypers):
            group = {"params": [p], "lr": 0.0, "weight_decay": weight_decay}
            if kind == 0:
                group.update(momentum=momentum, nesterov=bool(nesterov))
            else:
                group.update(betas=(beta1, beta2), eps=eps)
            groups.append(group)
        if kind == 0:
            optimizer = torch.optim.SGD(groups, lr=0.0, foreach=False)
        else:
            optimizer = torch.optim.AdamW(groups, lr=0.0, foreach=False)

        bad_elements = 0
        for step in range(steps):
            for group, lr, g in zip(optimizer.param_groups, lrs[step], grads[step].split(sizes)):
                group["lr"] = lr
                group["params"][0].grad = g.clone()
            optimizer.step()
            got_param = r.floats(total)
            got_state1 = r.floats(total)
            got_state2 = r.floats(total)
            with torch.no_grad():
                want_param = torch.cat([p.detach() for p in params])
                names = ("momentum_buffer", None) if kind == 0 else ("exp_avg", "exp_avg_sq")
                wants = []
                for name in names:
                    # SGD without momentum keeps a None buffer; the C++ writes zeros.
                    states = [optimizer.state[p].get(name) if name else None for p in params]
                    wants.append(torch.cat([torch.zeros_like(p) if s is None else s.detach()
                                            for p, s in zip(params, states)]))
            for what, got, want in (("param", got_param, want_param),
                                    (names[0], got_state1, wants[0]),
                                    (names[1] or "-", got_state2, wants[1])):
                bad = mismatches(got, want)
                bad_elements += len(bad)
                for i in bad[:max(0, 10 - shown)].tolist():
                    shown += 1
                    print(f"'{spec}' step {step + 1} {what}[{i}]: got {describe(got[i].item())}, "
                          f"want {describe(want[i].item())}")
        print(f"'{spec}': {steps} steps x {total} elements, params and state: "
              f"{bad_elements} mismatches")
        failed += bad_elements

    (clip_cases,) = r.unpack("Q")
    clip_bad = 0
    for _ in range(clip_cases):
        total_norm, max_norm = r.unpack("dd")
        (got,) = r.unpack("f")
        norm = torch.tensor(total_norm, dtype=torch.float32)
        want = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if mismatches(torch.tensor([got]), want.reshape(1)).numel():
            clip_bad += 1
            print(f"ClipScale({total_norm!r}, {max_norm!r}): got {describe(got)}, "
                  f"want {describe(want.item())}")
    print(f"ClipScale: {clip_cases} cases, {clip_bad} mismatches")
    failed += clip_bad
    capability = [line.strip() for line in torch.__config__.show().splitlines()
                  if "CPU capability" in line]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {capability}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
