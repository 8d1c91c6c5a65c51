"""Randomised serving schedules (issue 26, "How it is checked"): hypothesis draws schedules of
sequences joining, chunked appends and decode steps, drafts then a rollback, releases,
forks (a prefix of a live sequence starts a free row, sharing its complete pages) and moves
(export from one paged cache, load into a free row of the other), over two caches.

What every example checks:

* **Each sequence equals its tokens run alone**: every output a sequence got, at every
  position it still holds (a rolled-back draft's position is forgotten; moved sequences
  keep theirs), equals the same tokens run alone through a contiguous cache of batch 1
  (``test_paged.alone``, the unplaced layer): top-k bit-identical, outputs within float32
  rounding (``F32_REORDER``: a placed layer's ``o_proj`` sums in another order).
* **Page accounting, exactly, after every step**: ``PageTable.check()`` is clean on both
  caches, each row holds ``ceil(length / page_size)`` pages for the length the schedule
  gave it, and every page of its data shard that no row holds is free (a shared page counts
  once); on a mesh every leaf of both
  caches stays placed as it was made (the eager ``rollback``, ``release``, ``load`` run as
  one program each with the cache's shardings, ``glm5_dsa_jax.cache.eager``).

Over ``xla`` unplaced (most examples), ``pallas_interpret`` (a few), and placed on a TP 2
and a data x tp (2 x 2) mesh of the virtual CPU devices. Ops are drawn as ``(kind, cache,
seed)``; the seed draws the rows, counts and tokens, so hypothesis shrinks a failure to
its shortest schedule.

**Adding an op**: write ``_op_<kind>(sched, c, rng)`` that changes the caches through their
public API and keeps ``Schedule``'s model (``rows``, each ``Seq``'s tokens and outputs) in
step, and add ``<kind>`` to ``KINDS``; ``Schedule.check_pages`` and the final comparison
need nothing more (a fork's destination is a ``Seq`` whose tokens and outputs are its
source's first ``n``).

Time: the caches' geometry is fixed, every call is a chunk of ``C`` or one token, and the
layers are built once per module, so each variant compiles its two step programs, the
cache operations (``glm5_dsa_jax.cache.eager``) and ``alone`` once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import glm5_dsa_jax as gd
from glm5_dsa_jax.parallel import sharding as sh
from helpers import F32_REORDER, dp_mesh, f32_layer, tp_mesh
from test_paged import alone

C = 4  # the chunk width of appends and drafts; also max_rollback
MAX_SEQS, PAGE, PAGES_PER_SEQ = 4, 8, 8  # 64 tokens a sequence at most (alone's width: 80)
NUM_PAGES = MAX_SEQS * PAGES_PER_SEQ  # never short of pages: accounting, not refusals, here
GEOMETRY = dict(max_seqs=MAX_SEQS, num_pages=NUM_PAGES, page_size=PAGE, pages_per_seq=PAGES_PER_SEQ,
                max_rollback=C)


def cfg():
    return gd.DsaConfig.tiny(index_topk=4)  # 1 pool of up to 16 selected: a top-k that can be wrong


_LAYERS = {}


def layers(variant):
    """``(layer under test, unplaced reference layer)`` with the same weights, built once."""
    if variant not in _LAYERS:
        impl = "pallas_interpret" if variant == "pallas_interpret" else "xla"
        ref = f32_layer(cfg(), 1, seed=5, implementation=impl, block_q=8)
        layer = ref
        if variant == "tp2":
            layer = sh.shard_layer(f32_layer(cfg(), 1, seed=5), tp_mesh(2), "tp")
        elif variant == "data x tp":
            layer = sh.shard_layer(f32_layer(cfg(), 1, seed=5), dp_mesh((2, 2)), "tp", batch_axis="data")
        _LAYERS[variant] = layer, ref
    return _LAYERS[variant]


@dataclasses.dataclass
class Seq:
    """One sequence of the model: its tokens and, per position it holds, its output."""

    tokens: list = dataclasses.field(default_factory=list)  # [hidden] float32 each
    outputs: list = dataclasses.field(default_factory=list)  # (out [hidden], topk [W]) each

    def drop(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n:], self.outputs[len(self.outputs) - n:]


class Schedule:
    """Two paged caches and the model of what they hold: ``rows[c][b]`` the ``Seq`` in row
    ``b`` of cache ``c`` (None: free); ``done`` the released sequences."""

    def __init__(self, layer):
        self.layer = layer
        self.caches = [layer.init_paged_cache(**GEOMETRY) for _ in range(2)]
        self.placement = [[a.sharding for a in jax.tree.leaves(c)] for c in self.caches]
        self.rows = [[None] * MAX_SEQS for _ in range(2)]
        self.done = []

    def live(self, c, rng, min_length=0):
        """The rows of cache ``c`` holding a sequence of at least ``min_length`` tokens."""
        return [b for b, s in enumerate(self.rows[c]) if s is not None and len(s.tokens) >= min_length]

    def call(self, c, counts, rng, width):
        """One call of ``width`` on cache ``c``: row ``b`` appends ``counts[b]`` new tokens at
        random places of its chunk (garbage elsewhere), recorded in its ``Seq``."""
        h = self.layer.cfg.hidden_size
        x = rng.standard_normal((MAX_SEQS, width, h)).astype(np.float32) * 1e3
        mask = np.zeros((MAX_SEQS, width), bool)
        cols = {}
        for b, k in enumerate(counts):
            if k:
                cols[b] = np.sort(rng.choice(width, k, replace=False))
                x[b, cols[b]] = rng.standard_normal((k, h)).astype(np.float32)
                mask[b, cols[b]] = True
        out, topk, self.caches[c] = self.layer(jnp.asarray(x), attention_mask=jnp.asarray(mask), cache=self.caches[c])
        out, topk = np.asarray(out), np.asarray(topk)
        for b, where in cols.items():
            seq = self.rows[c][b]
            seq.tokens += list(x[b, where])
            seq.outputs += [(out[b, j], topk[b, j]) for j in where]

    def room(self, seq) -> int:
        return PAGES_PER_SEQ * PAGE - len(seq.tokens)

    def check_pages(self):
        """The page table of each cache against the model (the module doc), and a placed
        cache's every leaf where it was made. A page shared by several rows (``fork``) is
        held once: the free pages are those no row names."""
        for cache, rows, placement in zip(self.caches, self.rows, self.placement):
            if self.layer.mesh is not None:
                for a, want in zip(jax.tree.leaves(cache), placement, strict=True):
                    assert a.sharding.is_equivalent_to(want, a.ndim), (a.sharding, want)
            cache.pages.check()
            lengths = np.array([0 if s is None else len(s.tokens) for s in rows])
            np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
            table = np.asarray(cache.block_table)
            np.testing.assert_array_equal((table >= 0).sum(1), -(-lengths // PAGE))
            shards = cache.pages.shards
            distinct = [len(set(t[t >= 0].tolist())) for t in table.reshape(shards, -1, table.shape[1])]
            np.testing.assert_array_equal(np.asarray(cache.pages.n_free).reshape(-1),
                                          NUM_PAGES // shards - np.array(distinct))


# ---------------------------------------------------------------------------- the ops
def _op_step(sched, c, rng, width=C, join=0.6, full=False):
    """A chunked append (``width`` C) or a decode step (1): free rows may join (with
    probability ``join``) with new sequences, live rows send 0 .. ``width`` tokens each
    (``full``: every row ``width``)."""
    counts = [0] * MAX_SEQS
    for b in range(MAX_SEQS):
        seq = sched.rows[c][b]
        if seq is None and rng.random() < join:
            seq = sched.rows[c][b] = Seq()
        if seq is not None:
            counts[b] = int(min(width if full else rng.integers(0, width + 1), sched.room(seq)))
    sched.call(c, counts, rng, width)


def _op_decode(sched, c, rng):
    _op_step(sched, c, rng, width=1)


def _op_draft(sched, c, rng):
    """Drafts then a rollback: some live rows append ``d`` (1 .. C) drafts in one chunk and
    take back ``r`` (0 .. d) of them, per-row counts in one call."""
    rows = [b for b in sched.live(c, rng) if sched.room(sched.rows[c][b]) >= C and rng.random() < 0.8]
    if not rows:
        return
    d = {b: int(rng.integers(1, C + 1)) for b in rows}
    sched.call(c, [d.get(b, 0) for b in range(MAX_SEQS)], rng, C)
    n = np.zeros(MAX_SEQS, np.int32)
    for b in rows:
        n[b] = rng.integers(0, d[b] + 1)
        sched.rows[c][b].drop(int(n[b]))
    mask = np.zeros(MAX_SEQS, bool)
    mask[rows] = True
    sched.caches[c] = sched.caches[c].rollback(mask, n)


def _op_release(sched, c, rng):
    """A live row's sequence ends: its pages go back."""
    rows = sched.live(c, rng)
    if rows:
        b = int(rng.choice(rows))
        sched.caches[c] = sched.caches[c].release(np.arange(MAX_SEQS) == b)
        sched.done.append(sched.rows[c][b])
        sched.rows[c][b] = None


def _op_move(sched, c, rng):
    """A sequence moves from cache ``c`` to a free row of the other: export, release, load."""
    rows, free = sched.live(c, rng, min_length=1), [b for b in range(MAX_SEQS) if sched.rows[1 - c][b] is None]
    if rows and free:
        src, dst = int(rng.choice(rows)), int(rng.choice(free))
        exported = sched.caches[c].export(src)
        sched.caches[c] = sched.caches[c].release(np.arange(MAX_SEQS) == src)
        sched.caches[1 - c] = sched.caches[1 - c].load(dst, exported)
        sched.rows[1 - c][dst], sched.rows[c][src] = sched.rows[c][src], None


def _op_fork(sched, c, rng):
    """A live row's first ``n`` tokens start a free row of its data shard (shared pages): ``n``
    its whole length or a pool boundary (a mid-pool prefix is refused once the stage has moved
    past it, ``PagedCache.fork``); the new ``Seq`` is the source's first ``n`` tokens and
    their outputs (what the prefix run alone gives)."""
    cache = sched.caches[c]
    per_shard = MAX_SEQS // cache.pages.shards
    pairs = [(s, d) for s in sched.live(c, rng, min_length=1) for d in range(MAX_SEQS)
             if sched.rows[c][d] is None and s // per_shard == d // per_shard]
    if not pairs:
        return
    src, dst = pairs[int(rng.integers(len(pairs)))]
    seq = sched.rows[c][src]
    kp = sched.layer.cfg.index_kpool
    n = int(rng.choice([len(seq.tokens)] + list(range(kp, len(seq.tokens), kp))))
    sched.caches[c] = cache.fork(np.array([src]), np.array([dst]), np.array([n]))
    sched.rows[c][dst] = Seq(seq.tokens[:n], seq.outputs[:n])


KINDS = {"step": _op_step, "decode": _op_decode, "draft": _op_draft, "release": _op_release, "move": _op_move,
         "fork": _op_fork}

#: Drafts drawn twice as often as the other kinds: the schedules are about taking tokens back.
OPS = st.lists(st.tuples(st.sampled_from(["draft"] + sorted(KINDS)), st.integers(0, 1), st.integers(0, 2 ** 16)),
               min_size=4, max_size=12)


def run_schedule(variant, ops):
    layer, ref = layers(variant)
    sched = Schedule(layer)
    rng = np.random.default_rng(0)
    for _ in range(3):  # something to serve from the start: 3 pools, so 1 of them is selected
        _op_step(sched, 0, rng, join=1, full=True)
    sched.check_pages()
    for kind, c, seed in ops:
        KINDS[kind](sched, c, np.random.default_rng(seed))
        sched.check_pages()
    seqs = sched.done + [s for rows in sched.rows for s in rows if s is not None]
    for i, seq in enumerate(s for s in seqs if s.tokens):
        out, topk = alone(ref, np.stack(seq.tokens))
        np.testing.assert_array_equal(np.stack([t for _, t in seq.outputs]), topk, err_msg=f"sequence {i}: top-k")
        np.testing.assert_allclose(np.stack([o for o, _ in seq.outputs]), out, atol=F32_REORDER, rtol=F32_REORDER,
                                   err_msg=f"sequence {i}: outputs")


@settings(max_examples=12, deadline=None)
@given(ops=OPS)
@pytest.mark.slow
def test_schedules_xla(ops):
    run_schedule("xla", ops)


@settings(max_examples=2, deadline=None)
@given(ops=OPS)
def test_schedules_pallas_interpret(ops):
    run_schedule("pallas_interpret", ops)


@pytest.mark.parametrize("variant", ["tp2", "data x tp"])
@pytest.mark.slow
def test_schedules_placed(variant):
    @settings(max_examples=4, deadline=None)
    @given(ops=OPS)
    def placed(ops):
        run_schedule(variant, ops)

    placed()
