"""``DsaDecoder.steps`` / ``PagedDecoder.steps``: n decode steps in one compiled program
equal n calls exactly (outputs, top-k, every cache array), bf16, ``"xla"`` and
``"pallas_interpret"``, unrolled and rolled, a full layer and its shared layer, padding
and rows joining mid-way; a paged run that would run out of pages is refused before
anything runs. And a call's host share: once compiled, a decode call dispatches nothing
but its compiled program (no eager op, no compilation, no host-to-device transfer; a
contiguous call no device-to-host read either)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import DsaDecoder, PagedDecoder
from jax._src import core

N = 5  # decode steps


@pytest.fixture(scope="module")
def cfg():
    return gd.DsaConfig.tiny(index_kpool=2, index_topk=4)


def layers(cfg, implementation):
    kw = dict(implementation=implementation, block_q=8)
    return gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(1), **kw), gd.DsaAttention(cfg, 2, rngs=nnx.Rngs(2), **kw)


def inputs(cfg, b, s, seed):
    x = np.random.default_rng(seed).standard_normal((b, s, cfg.hidden_size))
    return jnp.asarray(x, jnp.bfloat16)


def same_cache(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def run_both(decoders, prefill, pmask, xs, mask, unroll):
    """A full + shared pair of ``decoders``: the prefill, then n calls, then the cache
    after the prefill put back (the same compiled step: no second compilation) and
    ``steps``; every output and cache array compared."""
    d1, d2 = decoders
    _, t = d1(prefill, pmask)
    d2(prefill, pmask, prev_topk=t)
    start = [(jax.tree.map(jnp.copy, d.cache), getattr(d, "length", None)) for d in decoders]
    cols = [d1(xs[:, i:i + 1], mask[:, i:i + 1]) for i in range(xs.shape[1])]
    o1, t1 = (jnp.concatenate(c, 1) for c in zip(*cols))
    cols = [d2(xs[:, i:i + 1], mask[:, i:i + 1], prev_topk=t1[:, i:i + 1]) for i in range(xs.shape[1])]
    o2, t2 = (jnp.concatenate(c, 1) for c in zip(*cols))
    want = [np.asarray(a) for a in (o1, t1, o2, t2)]
    after = [jax.tree.map(np.asarray, d.cache) for d in decoders]
    for d, (cache, length) in zip(decoders, start):
        d.cache = cache
        if length is not None:
            d.length = length
    g1, u1 = d1.steps(xs, mask, unroll=unroll)
    g2, u2 = d2.steps(xs, mask, prev_topk=u1, unroll=unroll)
    for a, b in zip(want, (g1, u1, g2, u2)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for a, d in zip(after, decoders):
        same_cache(a, d.cache)


@pytest.mark.parametrize("implementation,unroll", [("xla", True), ("pallas_interpret", None)])
@pytest.mark.slow
def test_contiguous_steps_equal_calls(cfg, implementation, unroll):
    decoders = [DsaDecoder(layer, 3, 32) for layer in layers(cfg, implementation)]
    prefill = inputs(cfg, 3, 9, 0)
    pmask = jnp.asarray(np.arange(9)[None] >= np.array([0, 4, 9])[:, None])  # row 2: no prompt
    mask = jnp.asarray(np.array([[1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [0, 0, 1, 1, 1]], bool))
    run_both(decoders, prefill, pmask, inputs(cfg, 3, N, 1), mask, unroll)
    assert decoders[0].length == decoders[1].length == 9 + N


@pytest.mark.parametrize("implementation,unroll", [("xla", None), ("pallas_interpret", True)])
@pytest.mark.slow
def test_paged_steps_equal_calls(cfg, implementation, unroll):
    decoders = [PagedDecoder(layer, 3, num_pages=12, page_size=4) for layer in layers(cfg, implementation)]
    prefill = inputs(cfg, 3, 7, 0)
    pmask = jnp.asarray(np.arange(7)[None] < np.array([7, 3, 0])[:, None])
    # row 1 pauses a step, row 2 joins at step 2: pages taken mid-run
    mask = jnp.asarray(np.array([[1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [0, 0, 1, 1, 1]], bool))
    run_both(decoders, prefill, pmask, inputs(cfg, 3, N, 1), mask, unroll)
    np.testing.assert_array_equal(decoders[0].lengths, [7 + N, 3 + N - 1, N - 2])


@pytest.mark.slow
def test_paged_steps_refused_before_anything_runs(cfg):
    full, _ = layers(cfg, "xla")
    dec = PagedDecoder(full, 2, num_pages=4, page_size=4)
    dec(inputs(cfg, 2, 6, 0))  # 2 + 2 pages: none free
    before = jax.tree.map(np.asarray, dec.cache)
    with pytest.raises(ValueError, match="sequence 0"):
        dec.steps(inputs(cfg, 2, 3, 1))  # row 0 reaches 9 tokens: a third page
    same_cache(before, dec.cache)
    dec.steps(inputs(cfg, 2, 2, 1))  # 8 tokens each: fits, and runs
    np.testing.assert_array_equal(dec.lengths, [8, 8])


@contextlib.contextmanager
def counted_dispatch():
    """A list of the eager primitives run inside the block (every primitive bound outside a
    trace, ``core.EvalTrace.process_primitive``, but a jitted program's own ``jit`` /
    ``pjit``), and a list of the XLA compilations."""
    ops, compiles = [], []
    real = core.EvalTrace.process_primitive

    def counting(self, primitive, args, params, /):
        if primitive.name not in ("jit", "pjit"):
            ops.append(primitive.name)
        return real(self, primitive, args, params)

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    core.EvalTrace.process_primitive = counting
    try:
        yield ops, compiles
    finally:
        core.EvalTrace.process_primitive = real
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_call_dispatches_only_its_program(cfg, kind):
    full, _ = layers(cfg, "xla")
    dec = DsaDecoder(full, 2, 32) if kind == "contiguous" else PagedDecoder(full, 2, num_pages=16, page_size=8)
    x, mask = inputs(cfg, 2, 1, 0), jnp.ones((2, 1), bool)
    xs, masks = inputs(cfg, 2, 3, 1), jnp.ones((2, 3), bool)
    for _ in range(2):  # compile, and fill the decoder's caches
        dec(x, mask), dec(x), dec.steps(xs, masks)
    # A paged call reads its mask on the host (the room check before donation); a
    # contiguous one reads nothing.
    guard = jax.transfer_guard("disallow") if kind == "contiguous" else jax.transfer_guard_host_to_device("disallow")
    with counted_dispatch() as (ops, compiles):
        jnp.ones(2) + 1  # the count sees an eager op
    assert ops
    with counted_dispatch() as (ops, compiles), guard:
        for _ in range(3):
            dec(x, mask)
            dec(x)
            dec.steps(xs, masks)
    assert ops == [] and compiles == [], (ops, compiles)
    assert dec.step.traces == 1
