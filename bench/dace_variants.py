"""A DaCe program of `a @ b` other than the backends' (archipelago/island/backends/
dace_program.py), for `bench/throughput.py --backend dace`'s kernel table. The table's
other lowerings (the MatMul library node's own loops, with and without `auto_optimize`)
are built from the `dace` backend's program, `dace_program.matmul_library`, left to DaCe's
default expansion (`pure`: no system BLAS here) instead of OpenBLAS.

Without `from __future__ import annotations`: DaCe reads the argument types from the live
annotations.
"""

import dace

N, K, M = dace.symbol("N"), dace.symbol("K"), dace.symbol("M")


@dace.program
def dot_products(a: dace.float32[N, K], bt: dace.float32[M, K], c: dace.float32[N, M]):  # noqa: ANN201
    """One dot product per element of c, both rows read along k (b given transposed)."""
    for i, j in dace.map[0:N, 0:M]:
        acc = dace.float32(0)
        for k in range(K):
            acc = acc + a[i, k] * bt[j, k]
        c[i, j] = acc
