"""The kernels over the paged cache's layout, in interpret mode at small shapes.

* ``sparse_mla`` over a shared latent pool ``[1, L, C]`` (``token_ids`` are physical slots)
  equals the same call over a per-row broadcast copy ``[B, L, C]``, bit for bit, for the
  reference and the kernel, one split and several; a slot no row names may hold NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import SparseMlaBlockSizes, sparse_mla


# ---------------------------------------------------------------------------------------
# sparse_mla over a shared latent pool
# ---------------------------------------------------------------------------------------


def _slot_rows(rng, b, nq, width, slots):
    """Distinct slot ids per row (prefix of valid ids, then -1), each row from its own
    random subset of ``slots``."""
    ids = np.full((b, nq, width), -1, np.int32)
    for i in range(b):
        for j in range(nq):
            n = int(rng.integers(0, min(width, len(slots)) + 1))
            ids[i, j, :n] = rng.choice(slots, size=n, replace=False)
    return ids


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_shared_latent_equals_broadcast_copy(impl, num_splits):
    rng = np.random.default_rng(10)
    b, nq, h, c, length, width = 3, 2, 4, 40, 48, 21
    q = jnp.asarray(rng.standard_normal((b, nq, h, c)), jnp.float32)
    pool = rng.standard_normal((1, length, c)).astype(np.float32)
    named = np.sort(rng.choice(length, size=30, replace=False))
    ids = _slot_rows(rng, b, nq, width, named)
    ids[0, 0] = -1  # an empty row
    ids[2, 1, 3] = length + 2  # out of range: not a slot
    blocks = SparseMlaBlockSizes(num_splits=num_splits, block_w=16)
    run = lambda lat: np.asarray(sparse_mla(
        q, jnp.asarray(lat), jnp.asarray(ids), scale=0.2, implementation=impl,
        block_sizes=blocks,
    ))
    want = run(np.broadcast_to(pool, (b, length, c)))
    np.testing.assert_array_equal(run(pool), want)
    assert np.isfinite(want).all() and (want[0, 0] == 0).all()
    if impl != "xla":
        # The kernel reads only the slots a row names (the reference reads the clamped slot
        # 0 of an empty slot, so it is held to this only where slot 0 is named).
        poisoned = pool.copy()
        unnamed = np.setdiff1d(np.arange(length), ids[ids >= 0])
        poisoned[0, unnamed] = np.nan
        np.testing.assert_array_equal(run(poisoned), want)


def test_latent_batch_must_be_one_or_b():
    q = jnp.zeros((3, 1, 4, 16), jnp.float32)
    ids = jnp.zeros((3, 1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"latent must be \[B=3, L, C=16\] or shared \[1, L"):
        sparse_mla(q, jnp.zeros((2, 8, 16), jnp.float32), ids, scale=1.0)
