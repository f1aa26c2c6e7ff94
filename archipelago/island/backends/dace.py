"""`training.backend = "dace"`: the model's linear layers and convolutions compute their
matrix products as a DaCe-compiled program (an SDFG lowered to C++ by DaCe, built by the
machine's g++) on the CPU, forward and backward.

Why per operator and not a whole-graph compiler: DaCe 1.0 has no PyTorch frontend, and the
torch.compile backend that lowers graphs to SDFGs (`docc-ai`) needed a BLAS shim, another
compiler and a recompilation per batch shape here (docs/backends.md). So every
`nn.Linear` (and every `nn.Conv2d`, as `unfold` + the same product) gets a forward that
calls `DaceProduct`, an autograd Function whose forward and backward are three products
with the one compiled program, `matmul(a, b) = a @ b` on row-major float32:

    y  = x @ w.T          = matmul(x, w.T)     (x: [N, K] activations, w: [M, K] the weight)
    dx = dy @ w           = matmul(dy, w)
    dw = dy.T @ x         = matmul(dy.T, x)

The transposes are contiguous copies made by torch (the weight's is small; dy's costs one
more pass over it). Everything else (attention, norms, activations, the loss) stays eager torch, and the
parameters stay ordinary torch parameters with their names unchanged (the module's class
is swapped, not the module), so autograd, DDP and FSDP inside the island, checkpoints and
the federation see no difference.

Cost (bench/throughput.py --backend dace): the program is DaCe's own code generation
(dace_program.py says which loop order and why); it has no register blocking as a BLAS
library has, so it is many times slower than eager's kernels. Compiled once per machine into the cache folder
(`<cache>/dace/<program>-<hash>`; about 7 s with g++) and loaded from there by every later run
and rank (a file lock keeps concurrent ranks from building it twice).
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_PROGRAM: Any = None  # the loaded program, once per process


def available() -> str | None:
    """None when DaCe can be imported, else how to install it."""
    try:
        import dace  # noqa: F401
    except ImportError as exc:
        return (f"training.backend = \"dace\" needs the dace package ({exc}); install it with "
                "`pip install --no-deps -r requirements-dace.txt` (make setup does)")
    return None


def describe() -> str:
    """What this backend is, for the island's fingerprint and logs."""
    import dace

    return f"dace {dace.__version__} (cpu, fp32)"


def check(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what the compiled program cannot compute: another device or float type."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"training.backend = \"dace\" computes on the CPU in float32; this island runs on "
                         f"{device.type} in {str(dtype).removeprefix('torch.')}: set training.device = \"cpu\" "
                         "and training.mixed_precision = \"fp32\", or training.backend = \"eager\"")


def apply(model: nn.Module, cache_dir: Path) -> int:
    """Every nn.Linear and ungrouped nn.Conv2d of `model` computes through the program, in
    place (names, parameters and initialisation untouched); the program is built or loaded
    now, so a missing compiler fails at the start and not at the first step. Returns how
    many modules were converted."""
    load(cache_dir)
    converted = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DaceLinear
            converted += 1
        elif type(module) is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros" \
                and isinstance(module.padding, tuple):
            module.__class__ = DaceConv2d
            converted += 1
    return converted


# ---- the program --------------------------------------------------------------------


def load(cache_dir: Path) -> Any:
    """The compiled `a @ b` program: built into `cache_dir`/dace once per machine, then
    loaded from there (a file lock keeps ranks that start together from building it twice)."""
    global _PROGRAM
    if _PROGRAM is not None:
        return _PROGRAM
    import dace
    from dace.config import Config

    from archipelago.island.backends import dace_program

    folder = cache_dir / "dace"
    folder.mkdir(parents=True, exist_ok=True)
    source = inspect.getsource(dace_program)  # an edited program is built anew
    digest = hashlib.sha256(f"{dace.__version__}\n{source}".encode()).hexdigest()[:12]
    Config.set("default_build_folder", value=str(folder))
    Config.set("compiler", "use_cache", value=True)  # load a build that exists instead of building again
    Config.set("compiler", "allow_view_arguments", value=True)  # torch's tensors reach it as numpy views
    with open(folder / f"matmul-{digest}.lock", "w") as lock, warnings.catch_warnings():
        fcntl.flock(lock, fcntl.LOCK_EX)
        warnings.simplefilter("ignore")  # DaCe's notes on memlet patterns while it parses the program
        sdfg = dace_program.matmul.to_sdfg(simplify=True)
        sdfg.name = f"archipelago_matmul_{digest}"
        try:
            _PROGRAM = sdfg.compile()
        except Exception as exc:  # noqa: BLE001 - DaCe's build errors come in many types; all mean the same here
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            raise ValueError(f"training.backend = \"dace\": building its program in {folder} failed "
                             f"({type(exc).__name__}: {first}); DaCe builds with cmake and a C++ compiler (g++): "
                             "install them, or set training.backend = \"eager\"") from exc
    return _PROGRAM


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` through the compiled program: a [N, K], b [K, M] -> [N, M], float32 on the CPU."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu":
        raise TypeError(f"the dace backend computes float32 on the CPU, got {a.dtype} on {a.device} "
                        "(autocast? set training.mixed_precision = \"fp32\")")
    n, k = a.shape
    m = b.shape[1]
    out = torch.empty(n, m, dtype=torch.float32)
    if n == 0 or m == 0:
        return out
    if k == 0:
        return out.zero_()
    if _PROGRAM is None:
        raise RuntimeError("the dace backend's program is not loaded: call dace.apply(model, cache_dir) or "
                           "dace.load(cache_dir) first")
    a, b = a.detach().contiguous(), b.detach().contiguous()
    _PROGRAM(a=a.numpy(), b=b.numpy(), c=out.numpy(), N=n, K=k, M=m)
    return out


class DaceProduct(torch.autograd.Function):
    """y = x @ w.T with x [N, K] and w [M, K], forward and backward through the program."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return matmul(x, w.t())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = ctx.saved_tensors
        dx = matmul(dy, w) if ctx.needs_input_grad[0] else None
        dw = matmul(dy.t(), x) if ctx.needs_input_grad[1] else None
        return dx, dw


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through the program: any leading dimensions, the bias added by torch."""
    y = DaceProduct.apply(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class DaceLinear(nn.Linear):
    """nn.Linear whose product runs through the DaCe program (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class DaceConv2d(nn.Conv2d):
    """nn.Conv2d (zero padding, no groups) as im2col: `unfold` (torch, whose backward folds)
    and one product through the DaCe program for the whole batch. Costs the unfolded input's memory
    (kernel area x the input), as any im2col convolution does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        kh, kw = self.kernel_size
        pad = self.padding
        assert not isinstance(pad, str), "apply() converts only convolutions with numeric padding"
        out_h = (height + 2 * pad[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        out_w = (width + 2 * pad[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        cols = F.unfold(x, self.kernel_size, dilation=self.dilation, padding=pad, stride=self.stride)
        rows = cols.transpose(1, 2).reshape(batch * out_h * out_w, -1)  # [B*L, C*kh*kw]
        y = DaceProduct.apply(rows, self.weight.reshape(self.out_channels, -1))  # [B*L, O]
        y = y.reshape(batch, out_h * out_w, self.out_channels).transpose(1, 2)
        y = y.reshape(batch, self.out_channels, out_h, out_w)
        return y + self.bias.view(1, -1, 1, 1) if self.bias is not None else y

