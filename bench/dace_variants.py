"""DaCe programs of `a @ b` other than the backends' (archipelago/island/backends/
dace_program.py), for `bench/throughput.py --backend dace`'s kernel table: what DaCe's own
lowering and transformations give for the model's products on this CPU.

Without `from __future__ import annotations`: DaCe reads the argument types from the live
annotations.
"""

import dace

N, K, M = dace.symbol("N"), dace.symbol("K"), dace.symbol("M")


@dace.program
def library_node(a: dace.float32[N, K], b: dace.float32[K, M], c: dace.float32[N, M]):  # noqa: ANN201
    """DaCe's MatMul library node with its default expansion here: no system BLAS, so its own
    loop nest (`pure`); the `dace` backend expands the same node to OpenBLAS instead."""
    c[:] = a @ b


@dace.program
def dot_products(a: dace.float32[N, K], bt: dace.float32[M, K], c: dace.float32[N, M]):  # noqa: ANN201
    """One dot product per element of c, both rows read along k (b given transposed)."""
    for i, j in dace.map[0:N, 0:M]:
        acc = dace.float32(0)
        for k in range(K):
            acc = acc + a[i, k] * bt[j, k]
        c[i, j] = acc
