"""Property tests (hypothesis) of the plain-jnp pipeline against independent numpy loops:
pooling from first_key, partial pools, the tail, the tie rule and the -1 conventions.

The functions under test run under ``jax.jit`` (how the layer runs them), built once here:
an eager call compiles each of its operations for every new shape, which made these
examples several times slower than one compiled program per shape.
"""

import jax
import numpy as np
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

import pallas_kernels as pk

SETTINGS = settings(max_examples=25, deadline=None)

kpool_compress_reference = jax.jit(pk.kpool_compress_reference)
first_valid = jax.jit(pk.first_valid)
visible_tail = jax.jit(pk.visible_tail, static_argnames="kpool")
topk_pools_reference = jax.jit(pk.topk_pools_reference, static_argnums=1)
expand_selection_reference = jax.jit(pk.expand_selection_reference,
                                     static_argnames=("kpool", "out_width"))


@st.composite
def masks(draw, max_b=3, max_l=24):
    b = draw(st.integers(1, max_b))
    length = draw(st.integers(1, max_l))
    rows = []
    for _ in range(b):
        kind = draw(st.sampled_from(["left", "right", "holes", "none", "all"]))
        m = np.ones(length, bool)
        if kind == "left":
            m[: draw(st.integers(0, length))] = False
        elif kind == "right":
            m[draw(st.integers(0, length)):] = False
        elif kind == "holes":
            m = np.array(draw(st.lists(st.booleans(), min_size=length, max_size=length)))
        elif kind == "none":
            m[:] = False
        rows.append(m)
    return np.stack(rows)


@SETTINGS
@given(masks(), st.sampled_from([1, 2, 3, 4, 8]), st.integers(0, 2**16))
def test_kpool_compress_matches_a_loop(mask, kpool, seed):
    rng = np.random.default_rng(seed)
    b, length = mask.shape
    d = 5
    keys = rng.standard_normal((b, length, d)).astype(np.float32)
    gate = rng.standard_normal((b, length, d)).astype(np.float32)
    ape = rng.standard_normal((kpool, d)).astype(np.float32)
    pooled, first_key, valid = map(np.asarray, kpool_compress_reference(
        jnp.asarray(keys), jnp.asarray(gate), jnp.asarray(mask), jnp.asarray(ape)))
    n_pools = max(1, length // kpool)
    assert pooled.shape == (b, n_pools, d)
    for i in range(b):
        fk = int(np.argmax(mask[i])) if mask[i].any() else length
        assert first_key[i] == fk
        for p in range(n_pools):
            slots = [fk + p * kpool + s for s in range(kpool)]
            ok = all(s < length and mask[i, s] for s in slots)
            assert valid[i, p] == ok, (i, p)
            if not ok:
                assert (pooled[i, p] == 0).all()
                continue
            logits = gate[i, slots] + ape
            w = np.exp(logits - logits.max(0))
            w /= w.sum(0)
            np.testing.assert_allclose(pooled[i, p], (w * keys[i, slots]).sum(0), rtol=1e-5, atol=1e-6)


@SETTINGS
@given(masks(), st.sampled_from([1, 2, 4, 5]))
def test_visible_tail_matches_the_reference_formula(mask, kpool):
    b, length = mask.shape
    first_key = np.asarray(first_valid(jnp.asarray(mask)))
    n_vis = np.cumsum(mask, axis=1).astype(np.int32)
    q_pos = np.where(mask, np.arange(length)[None], -1).astype(np.int32)
    tail = np.asarray(visible_tail(jnp.asarray(first_key), jnp.asarray(n_vis), jnp.asarray(q_pos),
                                   jnp.asarray(mask), kpool=kpool))
    assert tail.shape == (b, length, kpool - 1)
    for i in range(b):
        for t in range(length):
            count = n_vis[i, t] % kpool
            start = first_key[i] + n_vis[i, t] - count
            want = [start + o if (o < count and start + o < length and mask[i, min(start + o, length - 1)]
                                  and start + o <= q_pos[i, t]) else -1 for o in range(kpool - 1)]
            assert tail[i, t].tolist() == want
            if not mask[i, t]:
                assert (tail[i, t] == -1).all()


scores_st = st.lists(
    st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, 0.5, float("-inf"), float("nan"), 1e-45, -1e-45]),
    min_size=1, max_size=20,
)


@SETTINGS
@given(st.lists(scores_st, min_size=1, max_size=3).filter(lambda r: len({len(x) for x in r}) == 1), st.data())
def test_topk_tie_rule_matches_a_python_sort(rows, data):
    scores = np.array(rows, np.float32)[None]  # [1, Q, P]
    p = scores.shape[-1]
    k = data.draw(st.integers(0, p))
    got = np.asarray(topk_pools_reference(jnp.asarray(scores), k))
    for q, row in enumerate(scores[0]):
        def key(v):  # denormals and -0 are 0; NaN is -inf
            if np.isnan(v):
                return -np.inf
            return 0.0 if abs(v) < np.finfo(np.float32).tiny else float(v)
        order = sorted(range(p), key=lambda j: (-key(row[j]), j))[:k]
        want = sorted(j for j in order if key(row[j]) > -np.inf)
        assert got[0, q].tolist() == want + [-1] * (k - len(want))


@SETTINGS
@given(st.integers(1, 6), st.sampled_from([1, 2, 4]), st.integers(0, 2**16), st.booleans())
def test_expand_selection_row_conventions(k, kpool, seed, with_tail):
    rng = np.random.default_rng(seed)
    n_pools = 10
    chosen = np.sort(rng.choice(n_pools, size=rng.integers(0, k + 1), replace=False))
    pools = np.full((1, 1, k), -1, np.int32)
    pools[0, 0, : chosen.size] = chosen
    first_key = np.array([3], np.int32)
    tail = None
    if with_tail and kpool > 1:
        start = 3 + n_pools * kpool
        tail = np.array([[[start + o if o < rng.integers(0, kpool) else -1 for o in range(kpool - 1)]]], np.int32)
    width = k * kpool + (kpool - 1) + 2
    row = np.asarray(expand_selection_reference(
        jnp.asarray(pools), jnp.asarray(first_key), None if tail is None else jnp.asarray(tail),
        kpool=kpool, out_width=width))[0, 0]
    n = int((row >= 0).sum())
    assert (row[:n] >= 0).all() and (row[n:] == -1).all()  # valid prefix, -1 after
    assert (np.diff(row[:n]) > 0).all()  # ascending, no repeats
    expect = [3 + p * kpool + s for p in chosen for s in range(kpool)]
    if tail is not None:
        expect += [t for t in tail[0, 0] if t >= 0]
    assert row[:n].tolist() == expect


@SETTINGS
@given(st.lists(st.lists(st.integers(-3, 50), min_size=1, max_size=12), min_size=1, max_size=3)
       .filter(lambda r: len({len(x) for x in r}) == 1), st.integers(1, 16))
def test_compact_row_moves_valid_ids_to_the_front(rows, out_width):
    """``compact_row`` (a prefix-sum scatter, not a sort): each row's ids ``>= 0`` first, in
    their order, then ``-1``, cut or padded to ``out_width``; any negative id is ``-1``."""
    ids = np.array(rows, np.int32)[:, None]  # [B, 1, n]
    got = np.asarray(pk.compact_row(jnp.asarray(ids), out_width))
    assert got.shape == (len(rows), 1, out_width) and got.dtype == np.int32
    for b, row in enumerate(rows):
        want = ([v for v in row if v >= 0] + [-1] * (len(row) + out_width))[:out_width]
        assert got[b, 0].tolist() == want
