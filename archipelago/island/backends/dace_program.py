"""The DaCe programs behind `training.backend = "dace"` and `"dace-loops"` (dace.py builds
and calls them): both compute c = a @ b on row-major float32.

Kept apart, without `from __future__ import annotations`: DaCe reads the argument types
from the live annotations. The file's text names the compiled builds (dace.py hashes it),
so editing a program here builds it anew.
"""

import dace

N, K, M = dace.symbol("N"), dace.symbol("K"), dace.symbol("M")


@dace.program
def matmul_library(a: dace.float32[N, K], b: dace.float32[K, M], c: dace.float32[N, M]):  # noqa: ANN201
    """c = a @ b as DaCe's MatMul library node, expanded by dace_blas.py to a Gemm node and
    that to an OpenBLAS call: the product of the `dace` backend."""
    c[:] = a @ b


@dace.program
def matmul_loops(a: dace.float32[N, K], b: dace.float32[K, M], c: dace.float32[N, M]):  # noqa: ANN201
    """c = a @ b, row by row, as DaCe generates it (no library): a parallel map over the rows
    of c (OpenMP); each row is the sum over k of a[i, k] times row k of b, added in order of
    k. The innermost loop runs along contiguous rows of b and c, so g++ vectorises it
    (checked with -fopt-info-vec); a dot product per element instead (a @ b.T with both read
    along k) was 1.5x slower, and the MatMul library node's own loops (its `pure` expansion,
    without a BLAS) 4x slower still. The product of the `dace-loops` backend."""
    for i in dace.map[0:N]:
        for j in range(M):
            c[i, j] = 0
        for k in range(K):
            aik = a[i, k]
            for j in range(M):
                c[i, j] = c[i, j] + aik * b[k, j]
