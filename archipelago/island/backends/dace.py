"""`training.backend = "dace"` and `"dace-loops"`: the model's linear layers and
convolutions compute their matrix products through a DaCe-compiled program (an SDFG lowered
to C++ by DaCe, built by the machine's g++) on the CPU, forward and backward.

Why per operator and not a whole-graph compiler: DaCe 1.0 has no PyTorch frontend, and the
torch.compile backend that lowers graphs to SDFGs (`docc-ai`) needed a BLAS shim, another
compiler and a recompilation per batch shape here (docs/backends.md). So every
`nn.Linear` (and every `nn.Conv2d`, as `unfold` + the same product) gets a forward that
calls `DaceProduct`, an autograd Function whose forward and backward are three products
with one compiled program, `matmul(a, b) = a @ b` on row-major float32:

    y  = x @ w.T          = matmul(x, w.T)     (x: [N, K] activations, w: [M, K] the weight)
    dx = dy @ w           = matmul(dy, w)
    dw = dy.T @ x         = matmul(dy.T, x)

The transposes are contiguous copies made by torch (the weight's is small; dy's costs one
more pass over it). Everything else (attention, norms, activations, the loss) stays eager
torch, and the parameters stay ordinary torch parameters with their names unchanged (the
module's class is swapped, not the module), so autograd, DDP and FSDP inside the island,
checkpoints and the federation see no difference.

The two backends differ in the program (dace_program.py):

- `dace`: DaCe's MatMul library node, which DaCe expands to a Gemm node and that (through
  the implementation dace_blas.py registers) to an OpenBLAS call: DaCe's BLAS lowering,
  about as fast as eager here (bench/throughput.py --backend dace).
- `dace-loops`: the product as DaCe's own generated loops (a parallel map over rows, a
  vectorised inner loop), no library: many times slower than a BLAS (no register blocking),
  for a machine or device where DaCe generates the code itself.

Each program is compiled once per machine (3-8 s with g++), in a private folder, and cached
in `<cache>/dace/<program>-<hash>` with a record of its files signed with the island's local
key; every later run and rank loads verified private copies of the cached files
(dace_cache.py: whoever can write the cache folder cannot have native code loaded), and a
file lock keeps concurrent ranks from building it twice.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import inspect
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("archipelago.island")

LIBRARY, LOOPS = "library", "loops"  # dace_program.py's matmul_library and matmul_loops
_PROGRAMS: dict[str, Any] = {}  # the loaded programs, once per process
_INSTALL = "install it with `pip install --no-deps -r requirements-dace.txt` (make setup does)"


def missing(backend: str, modules: tuple[str, ...]) -> str | None:
    """None when `modules` can be imported, else what `backend` needs and how to install it."""
    for module in modules:
        try:
            __import__(module)
        except ImportError as exc:
            return f"training.backend = \"{backend}\" needs the {module} package ({exc}); {_INSTALL}"
    return None


def available() -> str | None:
    """None when DaCe and the OpenBLAS wheel can be imported, else how to install them."""
    return missing("dace", ("dace", "scipy_openblas32"))


def describe() -> str:
    """What this backend is, for the island's fingerprint and logs."""
    import dace

    from archipelago.island.backends import dace_blas

    return f"dace {dace.__version__}, MatMul library node -> OpenBLAS {dace_blas.version()}"


def refuse_unless_cpu_fp32(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what the compiled programs cannot compute: another device or float type."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"training.backend = \"{backend}\" computes on the CPU in float32; this island runs on "
                         f"{device.type} in {str(dtype).removeprefix('torch.')}: set training.device = \"cpu\" "
                         "and training.mixed_precision = \"fp32\", or training.backend = \"eager\"")


def check(device: torch.device, dtype: torch.dtype) -> None:
    refuse_unless_cpu_fp32("dace", device, dtype)


def apply(model: nn.Module, cache_dir: Path) -> int:
    """Every nn.Linear and ungrouped nn.Conv2d of `model` computes through the library
    program, in place; see `convert`."""
    return convert(model, cache_dir, DaceLinear, DaceConv2d)


def convert(model: nn.Module, cache_dir: Path, linear_class: type[DaceLinear], conv_class: type[DaceConv2d]) -> int:
    """Swap every nn.Linear and ungrouped nn.Conv2d of `model` to `linear_class` /
    `conv_class` (names, parameters and initialisation untouched); their program is built or
    loaded now, so a missing compiler fails at the start and not at the first step. Returns
    how many modules were converted."""
    load(cache_dir, linear_class.program)
    converted = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = linear_class
            converted += 1
        elif type(module) is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros" \
                and isinstance(module.padding, tuple):
            module.__class__ = conv_class
            converted += 1
    return converted


# ---- the program --------------------------------------------------------------------


def load(cache_dir: Path, program: str = LIBRARY) -> Any:
    """The compiled `a @ b` program (LIBRARY or LOOPS): built once per machine and cached in
    `cache_dir`/dace, signed; loaded from verified private copies of the cached files
    (dace_cache.py), or built anew, with a warning, when they do not match their record. A
    file lock keeps ranks that start together from building it twice."""
    if program in _PROGRAMS:
        return _PROGRAMS[program]
    import dace
    from dace.config import Config

    from archipelago.island.backends import dace_cache, dace_program

    folder = cache_dir / "dace"
    folder.mkdir(parents=True, exist_ok=True)
    source = f"{dace.__version__}\n{inspect.getsource(dace_program)}"  # an edited program is built anew
    if program == LIBRARY:
        from archipelago.island.backends import dace_blas

        dace_blas.set_threads(1)  # see dace_blas.set_threads
        source += f"\n{dace_blas.version()}\n{inspect.getsource(dace_blas)}"
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    Config.set("default_build_folder", value=str(folder))
    Config.set("compiler", "use_cache", value=False)  # DaCe's cache loads any library in the folder, unchecked
    Config.set("compiler", "allow_view_arguments", value=True)  # torch's tensors reach it as numpy views
    key, private = dace_cache.local_key(folder), dace_cache.private_folder()
    with _locked(folder / f"matmul-{program}-{digest}.lock"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DaCe's notes on memlet patterns while it parses the program
        try:
            sdfg = getattr(dace_program, f"matmul_{program}").to_sdfg(simplify=True)
            sdfg.name = f"archipelago_matmul_{program}_{digest}"
            if program == LIBRARY:
                dace_blas.expand(sdfg)
            cached = folder / sdfg.name
            problem = dace_cache.verified_copies(cached, sdfg.name, key, private)
            if problem is None:
                loaded = private
            else:
                if dace_cache.cached(cached, sdfg.name):
                    log.warning("dace backend: %s; building it anew", problem)
                loaded = _build(sdfg, private / "build-tree", cached, key)
        except dace_cache.BuildCacheError:
            raise
        except Exception as exc:  # noqa: BLE001 - DaCe's build errors come in many types; all mean the same here
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            raise ValueError(f"the DaCe backend's {program} program did not build in {folder} "
                             f"({type(exc).__name__}: {first}); DaCe builds with cmake and a C++ compiler (g++): "
                             "install them, or set training.backend = \"eager\"") from exc
        _PROGRAMS[program] = _open(sdfg, loaded / dace_cache.library_names(sdfg.name)[0])
    return _PROGRAMS[program]


def _build(sdfg: Any, tree: Path, cached: Path, key: bytes) -> Path:
    """Build `sdfg` in `tree` (private: no one else can change what is built or loaded), cache
    its library files signed in `cached`; the folder of the built files, to load."""
    from dace.codegen import compiler

    from archipelago.island.backends import dace_cache

    sdfg.build_folder = str(tree)
    sdfg.compile(return_program_handle=False)
    built = Path(compiler.get_binary_name(str(tree), sdfg.name)).parent
    dace_cache.publish(built, cached, sdfg.name, key)
    return built


def _open(sdfg: Any, library: Path) -> Any:
    """DaCe's handle on the verified or freshly built `library` (and the stub beside it)."""
    from dace.codegen import compiler

    try:
        return compiler.get_program_handle(str(library), sdfg)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"the DaCe backend cannot load its program from {library.parent} ({exc}); if $TMPDIR is "
                         "mounted noexec, set TMPDIR to a private folder that allows loading code") from exc


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`, opened without following a symlink and without truncating:
    a link planted there (`open(path, "w")`) would have emptied the file it points at."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"the DaCe backend's lock file {path} is a symbolic link (planted by someone who can "
                             "write the cache folder?): remove it, and keep data.cache_dir writable by you only") \
                from exc
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def matmul(a: torch.Tensor, b: torch.Tensor, program: str = LIBRARY) -> torch.Tensor:
    """`a @ b` through the compiled program: a [N, K], b [K, M] -> [N, M], float32 on the CPU."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu":
        raise TypeError(f"the dace backends compute float32 on the CPU, got {a.dtype} on {a.device} "
                        "(autocast? set training.mixed_precision = \"fp32\")")
    n, k = a.shape
    m = b.shape[1]
    out = torch.empty(n, m, dtype=torch.float32)
    if n == 0 or m == 0:
        return out
    if k == 0:
        return out.zero_()
    if program not in _PROGRAMS:
        raise RuntimeError(f"the DaCe backend's {program} program is not loaded: apply the backend to the "
                           f"model, or call dace.load(cache_dir, {program!r}) first")
    a, b = a.detach().contiguous(), b.detach().contiguous()
    _PROGRAMS[program](a=a.numpy(), b=b.numpy(), c=out.numpy(), N=n, K=k, M=m)
    return out


class DaceProduct(torch.autograd.Function):
    """y = x @ w.T with x [N, K] and w [M, K], forward and backward through `program`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, program: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.program = program
        return matmul(x, w.t(), program)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        dx = matmul(dy, w, ctx.program) if ctx.needs_input_grad[0] else None
        dw = matmul(dy.t(), x, ctx.program) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, program: str = LIBRARY) -> torch.Tensor:
    """F.linear through `program`: any leading dimensions, the bias added by torch."""
    y = DaceProduct.apply(x.reshape(-1, x.shape[-1]), weight, program).reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class DaceLinear(nn.Linear):
    """nn.Linear whose product runs through a DaCe program (same parameters and names)."""

    program = LIBRARY

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.program)


class DaceConv2d(nn.Conv2d):
    """nn.Conv2d (zero padding, no groups) as im2col: `unfold` (torch, whose backward folds)
    and one product through a DaCe program for the whole batch. Costs the unfolded input's
    memory (kernel area x the input), as any im2col convolution does."""

    program = LIBRARY

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        kh, kw = self.kernel_size
        pad = self.padding
        assert not isinstance(pad, str), "apply() converts only convolutions with numeric padding"
        out_h = (height + 2 * pad[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        out_w = (width + 2 * pad[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        cols = F.unfold(x, self.kernel_size, dilation=self.dilation, padding=pad, stride=self.stride)
        rows = cols.transpose(1, 2).reshape(batch * out_h * out_w, -1)  # [B*L, C*kh*kw]
        y = DaceProduct.apply(rows, self.weight.reshape(self.out_channels, -1), self.program)  # [B*L, O]
        y = y.reshape(batch, out_h * out_w, self.out_channels).transpose(1, 2)
        y = y.reshape(batch, self.out_channels, out_h, out_w)
        return y + self.bias.view(1, -1, 1, 1) if self.bias is not None else y

