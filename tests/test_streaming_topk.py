"""``streaming_topk`` equals ``topk_pools_reference`` on the whole row, in any tiling (the
last tile read from ``P - tile`` when ``tile`` does not divide ``P``), and reads only the
live tiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from pallas_kernels.selection import topk_pools_reference
from pallas_kernels.streaming_selection import streaming_topk

# Few distinct values, so ties (and -0.0 against +0.0, and -inf, NaN) are the common case.
VALUES = [-np.inf, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, np.nan]


def _slice_scores(start, scores, tile):
    return jax.lax.dynamic_slice_in_dim(scores, start, tile.shape[0], axis=1)


@functools.cache
def _jitted(rows, n_pools, tile, select_k):
    """``streaming_topk`` over ``[rows, n_pools]`` scores, jitted once per static geometry:
    the scores are an argument, so examples that share a geometry share one compilation
    (60 examples draw 29 geometries)."""
    return jax.jit(lambda scores, n: streaming_topk(
        _slice_scores, (scores, jnp.zeros((tile,))), n, tile=tile, n_pools=n_pools,
        select_k=select_k, rows=(rows,)))


#: The reference jitted (one compilation per shape and ``select_k``, not one per operation
#: of an eager call): the same operations, so the same ids.
_reference = jax.jit(topk_pools_reference, static_argnums=1)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 3), n_pools=st.integers(1, 40))
def test_equals_reference(data, rows, n_pools):
    tile = data.draw(st.sampled_from(sorted({1, 3, 8, 16, n_pools} & set(range(1, n_pools + 1)))))
    select_k = data.draw(st.integers(0, n_pools))
    vals = data.draw(st.lists(st.sampled_from(VALUES), min_size=rows * n_pools, max_size=rows * n_pools))
    scores = jnp.asarray(np.array(vals, np.float32).reshape(rows, n_pools))
    n_tiles = -(-n_pools // tile)
    got = _jitted(rows, n_pools, tile, select_k)(scores, jnp.int32(n_tiles))
    want = _reference(scores, select_k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_reads_only_live_tiles():
    # Tiles past n_tiles are never scored: the second tile's scores would win if read.
    scores = jnp.asarray([[3.0, 1.0, 2.0, 5.0, 9.0, 9.0, 9.0, 9.0]])
    ops = (scores, jnp.zeros((4,)))
    kw = dict(tile=4, n_pools=8, select_k=2, rows=(1,))
    assert streaming_topk(_slice_scores, ops, jnp.int32(1), **kw).tolist() == [[0, 3]]
    assert streaming_topk(_slice_scores, ops, jnp.int32(2), **kw).tolist() == [[4, 5]]
    assert streaming_topk(_slice_scores, ops, jnp.int32(0), **kw).tolist() == [[-1, -1]]


def test_with_keys_returns_the_ids_order_keys():
    """``with_keys``: the chosen ids' ``order_key`` of their scores (``NEG_INF_KEY`` where the
    id is ``-1``), what context parallelism's candidate merge ranks by; the ids unchanged."""
    from pallas_kernels._order_key import NEG_INF_KEY, order_key

    scores = jnp.asarray([[3.0, -0.0, 2.0, 5.0, -np.inf, 9.0, 1.0, 9.0], [-np.inf] * 6 + [1.0, -2.0]])
    ops = (scores, jnp.zeros((3,)))
    kw = dict(tile=3, n_pools=8, select_k=4, rows=(2,))
    ids, keys = streaming_topk(_slice_scores, ops, jnp.int32(3), with_keys=True, **kw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(streaming_topk(_slice_scores, ops, jnp.int32(3), **kw)))
    assert ids.tolist() == [[0, 3, 5, 7], [6, 7, -1, -1]]
    want = np.where(np.asarray(ids) >= 0,
                    np.asarray(order_key(jnp.take_along_axis(scores, jnp.maximum(ids, 0), axis=1))), NEG_INF_KEY)
    np.testing.assert_array_equal(np.asarray(keys), want)
