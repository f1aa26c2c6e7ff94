"""DaCe's BLAS library nodes, expanded to the OpenBLAS of the `scipy-openblas32` wheel:
the `training.backend = "dace"` products (dace.py).

DaCe lowers `c[:] = a @ b` to its MatMul library node, which expands to a Gemm node; a Gemm
node is expanded by the implementation it names, each a DaCe *expansion* that declares the
*environment* it builds in (headers, include folders, libraries, flags). DaCe's own OpenBLAS
expansion expects a system OpenBLAS found by CMake's FindBLAS; this machine has none, and a
system library would make the build depend on the host. So this module registers one more
implementation of DaCe's Gemm node, `archipelago_openblas`: DaCe's OpenBLAS code (the same
`cblas_sgemm` call, its arguments derived by DaCe from the memlets' shapes and strides) in
an environment that points at the wheel's header and library. The wheel prefixes its
symbols (`scipy_cblas_sgemm`), so the environment renames the one call DaCe emits with a
preprocessor define. This is how DaCe is extended for a new library or device: an
environment and an expansion, registered from outside DaCe, no fork.

Importing this module registers both with DaCe (once per process); it needs `dace` and
`scipy_openblas32` (requirements-dace.txt).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import dace
import dace.library
import scipy_openblas32
from dace.libraries.blas.nodes.gemm import ExpandGemmOpenBLAS, Gemm
from dace.transformation.transformation import ExpandTransformation

IMPLEMENTATION = "archipelago_openblas"
LIBRARY = os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so")


@dace.library.environment
class WheelOpenBLAS:
    """The scipy-openblas32 wheel as a DaCe build environment (the fields DaCe requires)."""

    cmake_minimum_version = None
    cmake_packages: list[str] = []
    cmake_variables: dict[str, str] = {}
    cmake_includes = [scipy_openblas32.get_include_dir()]
    cmake_libraries = [LIBRARY]
    cmake_compile_flags = ["-Dcblas_sgemm=scipy_cblas_sgemm"]  # the wheel's prefixed symbol
    cmake_link_flags = [f"-Wl,-rpath,{scipy_openblas32.get_lib_dir()}"]  # found at run time without LD_LIBRARY_PATH
    cmake_files: list[str] = []
    headers = ["cblas.h"]
    state_fields: list[str] = []
    init_code = ""
    finalize_code = ""
    dependencies: list[Any] = []


@dace.library.register_expansion(Gemm, IMPLEMENTATION)
class ExpandGemmWheelOpenBLAS(ExpandTransformation):
    """DaCe's OpenBLAS expansion of a Gemm node, built in `WheelOpenBLAS`."""

    environments = [WheelOpenBLAS]

    @staticmethod
    def expansion(node: Any, state: Any, sdfg: Any) -> Any:
        return ExpandGemmOpenBLAS.expansion(node, state, sdfg)


def version() -> str:
    """The OpenBLAS version of the wheel (for the island's declared compute)."""
    return str(scipy_openblas32.get_openblas_config().split()[1])


def set_threads(threads: int) -> None:
    """OpenBLAS's own thread count (its default: every core). The dace backend sets 1: OpenBLAS
    runs its threads beside torch's OpenMP pool, whose threads keep spinning for a while after
    each eager operator, so two OpenBLAS threads on a 2-core machine made the trainer slower
    (0.32x eager's tokens/s, llama3 debug) than one (0.59x); the products then use one core
    each call while eager's use all."""
    ctypes.CDLL(LIBRARY).scipy_openblas_set_num_threads(ctypes.c_int(max(1, threads)))


def expand(sdfg: Any) -> None:
    """Expand `sdfg`'s MatMul nodes to Gemm nodes, and those through OpenBLAS (in place)."""
    sdfg.expand_library_nodes(recursive=False)  # MatMul -> a nested SDFG holding a Gemm node
    for node, _ in sdfg.all_nodes_recursive():
        if isinstance(node, Gemm):
            node.implementation = IMPLEMENTATION
    sdfg.expand_library_nodes()
