"""Gradients of ``sparse_mla``: the token-major ``selection_transpose``, the ``"xla"``
backward against ``jax.vjp`` of the plain reference and float64 finite differences, the
Pallas backward (interpret mode) against ``"xla"``, determinism, and the block-size checks.

Id rows hold ``-1`` and ids ``>= L`` anywhere, rows with no valid id, and one row selected
by every query, so the masking, the zero gradient of an empty row and the transpose's
many-queries-per-row sums are all exercised. Shapes are tiny: interpret mode runs every
program on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.transpose import selection_transpose


def _transpose_oracle(token_ids: np.ndarray, length: int, shared: bool, block_rows: int):
    """The transpose by Python loops: {(block, query): mask}."""
    b, nq, _ = token_ids.shape
    out: dict[tuple[int, int], int] = {}
    for bi in range(b):
        for qi in range(nq):
            for i in token_ids[bi, qi]:
                if 0 <= i < length:
                    r = (0 if shared else bi) * length + int(i)
                    key = (r // block_rows, bi * nq + qi)
                    out[key] = out.get(key, 0) | (1 << (r % block_rows))
    return out


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("block_rows", [1, 16, 32])
def test_selection_transpose_matches_loops(shared, block_rows):
    rng = np.random.default_rng(block_rows + shared)
    b, nq, w, length = 2, 5, 7, 70
    ids = rng.integers(-2, length + 3, size=(b, nq, w)).astype(np.int32)
    ids[0, 1] = -1  # a query selecting nothing
    ids[1, 2, :3] = 33  # a repeated id: its bit once
    ids[:, :, 0] = 31  # one row selected by every query (bit 31 when block_rows = 32)
    t = selection_transpose(jnp.asarray(ids), length, shared=shared, block_rows=block_rows)
    start, query, mask = (np.asarray(a) for a in t)
    assert all(a.dtype == np.int32 for a in (start, query, mask))
    n_blocks = -(-(1 if shared else b) * length // block_rows)
    assert start.shape == (n_blocks + 1,) and query.shape == mask.shape == (b * nq * w,)
    got = {}
    for k in range(n_blocks):
        qs = query[start[k]:start[k + 1]]
        assert list(qs) == sorted(set(qs)), "a block's entries: increasing queries, once each"
        for e in range(start[k], start[k + 1]):
            got[(k, int(query[e]))] = int(mask[e]) & 0xFFFFFFFF
    assert got == _transpose_oracle(ids, length, shared, block_rows)
    n = start[-1]
    assert (query[n:] == -1).all() and (mask[n:] == 0).all() and (query[:n] >= 0).all()


def test_selection_transpose_jits_and_checks():
    ids = jnp.asarray([[[0, 5, -1], [5, 4, 9]]], jnp.int32)
    f = jax.jit(lambda i: selection_transpose(i, 6, shared=False, block_rows=4))
    start, query, mask = f(ids)
    # block 0 (rows 0-3): query 0 (id 0); block 1 (rows 4-7): query 0 (5), query 1 (5, 4)
    assert start.tolist() == [0, 1, 3] and query.tolist() == [0, 0, 1, -1, -1, -1]
    assert mask.tolist() == [1, 2, 3, 0, 0, 0]  # id 9 >= L selects nothing
    with pytest.raises(ValueError, match="block_rows"):
        selection_transpose(ids, 6, shared=False, block_rows=33)
    with pytest.raises(ValueError, match="token_ids"):
        selection_transpose(ids[0], 6, shared=False, block_rows=4)
