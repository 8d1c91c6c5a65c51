"""Sequences that move (issue 26, deliverable 3): ``PagedCache.export`` / ``load`` and the
``PagedDecoder`` wrappers, against the sequence staying where it was prefilled.

* Equivalence: sequences prefilled in ragged chunks on cache A (lengths ending mid-pool and
  mid-page), one exported and loaded into cache B of another page count and page size, into
  another row, beside a sequence B already serves; then the same decode steps on both: the
  moved sequence's top-k bit-identical and outputs equal within float32 rounding, for
  ``pallas_interpret`` on fp8 caches with B unplaced, ``xla`` on bf16 caches with B placed on
  a data x tp mesh (2 x 2) of the virtual CPU devices (its shardings kept). On a TP 2 mesh
  and into pages of another size, a loaded sequence exports again bit for bit (fp8: values
  and scales). ``PageTable.check`` is clean after every load.
* Bad input: every refusal (geometry, layer kind, dtype, stage dtype, pool size, row in use
  or out of range, too long, too few free pages in the row's data shard, an empty or
  released row to export, an export that contradicts itself (its rollback state
  included: ``kpool``, ``stage_from``), a traced cache) raises
  ``ValueError`` naming the field, and every leaf of the cache is unchanged.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_dsa_jax as gd
from glm5_dsa_jax.cache import ExportedSequence, transfer
from glm5_dsa_jax.parallel import sharding as sh
from helpers import F32_REORDER, dp_mesh, f32_layer, tiny8, tp_mesh
from test_data_parallel import collectives
from test_layer_steps import backend_compiles

ATOL = RTOL = F32_REORDER
#: Mid-pool (KP 4) and mid-page (8 on A, 16 on B) all; 29 and 26 both fill 2 pages of 16 and
#: 29, 26 and 18 all pad to 8 pages of 4: each test's loads share one write program.
LENGTHS = (29, 18, 26)
DECODE = 3


def cfg():
    return tiny8(index_topk=4)  # 4 of up to 10 pools selected: a top-k that can be wrong


def layer_of(implementation="xla", layer_idx=1):
    return f32_layer(cfg(), layer_idx, seed=3, implementation=implementation, block_q=8)


def prefill(dec, lengths, seed=0, chunk=8):
    """Sequence ``i`` (``lengths[i]`` tokens) into row ``i`` of ``dec``, in chunks of ``chunk``
    with ragged masks (each row sends a random count a step, 1 to ``chunk``, anywhere in the
    chunk; at ``chunk`` 1: its next token or none); the rest of a chunk is garbage."""
    rng = np.random.default_rng(seed)
    seqs = [rng.standard_normal((n, cfg().hidden_size)).astype(np.float32) for n in lengths]
    rows = dec.cache.max_seqs
    sent = [0] * len(seqs)
    while any(s < len(x) for s, x in zip(sent, seqs)):
        x = rng.standard_normal((rows, chunk, cfg().hidden_size)).astype(np.float32) * 1e3
        mask = np.zeros((rows, chunk), bool)
        for i, seq in enumerate(seqs):
            k = min(int(rng.integers(chunk > 1, chunk + 1)), len(seq) - sent[i])
            cols = np.sort(rng.choice(chunk, k, replace=False))
            x[i, cols], mask[i, cols] = seq[sent[i]:sent[i] + k], True
            sent[i] += k
        dec(x, mask)


def decode(dec, rows_tokens, steps):
    """``steps`` decode steps; ``rows_tokens[row] = [steps, hidden]`` for the rows that run.
    Returns ``{row: (out [steps, hidden], topk [steps, W])}``."""
    got = {r: ([], []) for r in rows_tokens}
    for t in range(steps):
        x = np.zeros((dec.cache.max_seqs, 1, cfg().hidden_size), np.float32)
        mask = np.zeros((dec.cache.max_seqs, 1), bool)
        for r, toks in rows_tokens.items():
            x[r, 0], mask[r, 0] = toks[t], True
        out, topk = dec(x, mask)
        for r in rows_tokens:
            got[r][0].append(np.asarray(out)[r, 0])
            got[r][1].append(np.asarray(topk)[r, 0])
    return {r: (np.stack(o), np.stack(k)) for r, (o, k) in got.items()}


def bits(a, dtype):
    """``a``'s bytes as ``dtype`` (a bit-for-bit comparison; a scalar as one element)."""
    return np.atleast_1d(np.asarray(a)).view(dtype)


def assert_same_sequence(got, want, what):
    np.testing.assert_array_equal(got[1], want[1], err_msg=f"{what}: top-k")
    np.testing.assert_allclose(got[0], want[0], atol=ATOL, rtol=RTOL, err_msg=f"{what}: outputs")


_REFERENCE = {}


def reference(implementation, dtype):
    """Sequences ``LENGTHS`` prefilled on A (3 rows, 16 pages of 8 tokens) in ragged chunks,
    each exported, then ``DECODE`` steps on A: ``(exports, tokens, results)``, made once per
    (implementation, dtype) and shared by the tests (A's programs compile once)."""
    key = (implementation, dtype)
    if key not in _REFERENCE:
        layer = layer_of(implementation)
        a = gd.PagedDecoder(layer, 3, num_pages=16, page_size=8, cache_dtype=dtype)
        chunk = CHUNK[implementation]
        prefill(a, LENGTHS, chunk=chunk)
        exports = {i: a.export(i) for i in range(len(LENGTHS))}
        toks = np.random.default_rng(7).standard_normal((3, DECODE, cfg().hidden_size)).astype(np.float32)
        results = decode(a, {i: toks[i] for i in range(3)}, DECODE)
        assert a.step.traces == (2 if chunk > 1 else 1)
        _REFERENCE[key] = exports, toks, results, layer
    return _REFERENCE[key]


#: Prefill chunk length: ``pallas_interpret`` prefills in steps of one token (ragged: each
#: row sends its next token or not), as a chunk program of its kernels costs seconds to
#: compile; ``xla`` in ragged chunks of 8.
CHUNK = {"xla": 8, "pallas_interpret": 1}


MOVED = {0: 3, 2: 1}  # row on A -> row on B


def move_and_compare(layer_b, implementation, dtype, num_pages=9, page_size=16):
    """B (4 rows, ``num_pages`` of ``page_size``) first serves a sequence of its own in row 0
    (5 tokens, one a step), then takes sequences 0 and 2 of A into rows 3 and 1; every row
    decodes: the moved sequences as on A. Returns B."""
    exports, toks, on_a, _ = reference(implementation, dtype)
    b = gd.PagedDecoder(layer_b, 4, num_pages=num_pages, page_size=page_size, cache_dtype=dtype)
    own = np.random.default_rng(9).standard_normal((5 + DECODE, cfg().hidden_size)).astype(np.float32)
    decode(b, {0: own}, 5)
    for src, dst in MOVED.items():
        assert isinstance(exports[src], ExportedSequence) and exports[src].length == LENGTHS[src]
        b.load(dst, exports[src])
        b.cache.pages.check()
    assert b.lengths.tolist() == [5, LENGTHS[2], 0, LENGTHS[0]]
    with backend_compiles() as seen:  # the loaded cache is the step's to take as it is
        on_b = decode(b, {0: own[5:]} | {dst: toks[src] for src, dst in MOVED.items()}, DECODE)
    assert not seen, f"{len(seen)} compilations of B's warm decode after the loads"
    for src, dst in MOVED.items():
        assert_same_sequence(on_b[dst], on_a[src], f"sequence {src} moved to row {dst}")
    assert b.step.traces == 1  # B compiled its decode step only: a load is no step
    return b


@pytest.mark.slow
def test_moved_sequence_decodes_as_where_it_was_prefilled():
    """Unplaced, ``pallas_interpret`` on fp8 caches (``xla`` on bf16: the mesh tests below;
    one reference each, as their compilations dominate the file's time)."""
    move_and_compare(reference("pallas_interpret", "fp8")[3], "pallas_interpret", "fp8")


def test_export_is_the_sequence_as_stored_and_a_load_re_pages_it():
    """fp8: the e4m3 values and their scales (not dequantised), the complete pools only, the
    stage; after a load into pages of another size, the export is the same bit for bit (a
    shared-indexer layer's too: latent rows only)."""
    exports, _, _, _ = reference("pallas_interpret", "fp8")
    e = exports[2]
    kp, d = cfg().index_kpool, cfg().index_head_dim
    n = LENGTHS[2]
    assert e.latent.dtype == jnp.float8_e4m3fn and e.latent.shape == (n, cfg().kv_cache_dim)
    assert e.latent_scale.shape == (n,) and e.pooled.shape == (n // kp, d)
    assert e.pooled_scale.shape == (n // kp,) and e.stage_keys.shape == (kp, d)
    assert e.stage_keys.dtype == np.float32 and e.stage_gate.dtype == np.float32  # the layer's dtype
    assert (e.latent_scale != 1).all() and (e.pooled_scale != 1).all()  # real rows, not padding
    b = gd.init_paged_cache(cfg(), 3, num_pages=24, page_size=4, dtype="fp8", stage_dtype=jnp.float32)
    for row, src in ((1, 2), (0, 1), (2, 0)):  # 7, 5 and 8 pages of 4, each padded to 8
        b = b.load(row, exports[src])
        for x, y in zip(jax.tree.leaves(exports[src]), jax.tree.leaves(b.export(row))):
            np.testing.assert_array_equal(bits(x, np.uint8), bits(y, np.uint8))
    b.pages.check()
    assert int(b.pages.n_free) == 24 - 7 - 5 - 8
    # A shared-indexer layer's sequence: latent rows only.
    shared = fields(e, pooled=None, pooled_scale=None, stage_keys=None, stage_gate=None, stage_from=None,
                    kpool=None)
    c = gd.init_paged_cache(cfg(), 2, num_pages=4, page_size=16, dtype="fp8", has_indexer=False).load(1, shared)
    back = c.export(1)
    assert back.pooled is None and back.stage_keys is None and not back.has_indexer
    np.testing.assert_array_equal(back.latent.view(np.uint8), e.latent.view(np.uint8))
    np.testing.assert_array_equal(back.latent_scale, e.latent_scale)


@pytest.mark.slow
def test_move_onto_a_data_x_tp_mesh():
    """B placed on a data x tp mesh (heads split over tp 2, pools split by sequence and page
    over data 2): the load keeps every field where it was, each row took its own shard's
    pages, and the moved sequences decode as on A."""
    mesh = dp_mesh((2, 2))
    layer_b = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    b = move_and_compare(layer_b, "xla", "bfloat16", num_pages=10)
    for a, want in zip(jax.tree.leaves(b.cache), jax.tree.leaves(sh.cache_shardings(b.cache, mesh, "data"))):
        assert a.sharding.is_equivalent_to(want, a.ndim)
    # rows 0, 1 are data shard 0 (5 pages: 1 + 2 taken), rows 2, 3 shard 1 (2 taken)
    assert np.asarray(b.cache.pages.n_free).tolist() == [5 - 1 - 2, 5 - 2]
    exports = reference("xla", "bfloat16")[0]
    for src, dst in MOVED.items():  # exported from the mesh: the moved tokens, then DECODE more
        again, n = b.export(dst), LENGTHS[src]
        assert again.length == n + DECODE
        np.testing.assert_array_equal(again.latent[:n].view(np.uint16), exports[src].latent.view(np.uint16))
        np.testing.assert_array_equal(again.pooled[:n // 4].view(np.uint16), exports[src].pooled.view(np.uint16))
    # Each data shard writes its own pages: no pool is gathered; only int32 bookkeeping is reduced.
    b.release(np.array([False, True, False, False]))
    hlo = transfer.load_hlo(b.cache, 1, exports[2])
    ops = collectives(hlo)
    assert not any(ops[k] for k in ("all-gather", "collective-permute", "all-to-all", "reduce-scatter")), ops
    assert all(re.search(r"= s32\[\d?\]\S* all-reduce", ln) for ln in ops["all-reduce"]), ops["all-reduce"]


def test_move_onto_a_tp_mesh():
    """B on a TP 2 mesh (pools replicated): the loaded cache stays replicated, its page
    table valid, and exporting the sequence again gives it bit for bit (the decode of a
    placed cache: the data x tp test above; TP alone reads the same replicated arrays)."""
    exports, _, _, _ = reference("xla", "bfloat16")
    layer_b = sh.shard_layer(layer_of(), tp_mesh(2), "tp")
    b = layer_b.init_paged_cache(2, num_pages=6, page_size=16, dtype="bfloat16")
    b = b.load(1, exports[2]).load(0, exports[1])
    b.pages.check()
    for a, want in zip(jax.tree.leaves(b), jax.tree.leaves(sh.cache_shardings(b, layer_b.mesh))):
        assert a.sharding.is_equivalent_to(want, a.ndim)
    for row, src in ((1, 2), (0, 1)):
        for x, y in zip(jax.tree.leaves(exports[src]), jax.tree.leaves(b.export(row))):
            np.testing.assert_array_equal(bits(x, np.uint16), bits(y, np.uint16))


# ---------------------------------------------------------------------------- bad input
def snapshot(cache):
    return [np.asarray(a).copy() for a in jax.tree.leaves(cache)]


def assert_unchanged(before, cache):
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == len(before)
    for a, b in zip(before, leaves):
        np.testing.assert_array_equal(a, np.asarray(b))


def assert_refused(call, cache, match):
    """``call()`` raises ``ValueError`` matching ``match`` and every leaf of ``cache`` is as before."""
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        call()
    assert_unchanged(before, cache)


def fields(e: ExportedSequence, **change) -> ExportedSequence:
    """``e`` with some fields replaced (a hand-built export)."""
    names = ("latent", "latent_scale", "pooled", "pooled_scale", "stage_keys", "stage_gate", "stage_from", "kpool")
    return ExportedSequence(**({n: getattr(e, n) for n in names} | change))


def test_export_refusals():
    exports, _, _, _ = reference("xla", "bfloat16")
    cache = gd.init_paged_cache(cfg(), 2, num_pages=8, page_size=8, dtype="bfloat16")
    assert_refused(lambda: cache.export(0), cache, r"row 0 holds no sequence \(length 0: empty or released\)")
    cache = cache.load(1, exports[1])
    released = cache.release(jnp.asarray([False, True]))
    assert_refused(lambda: released.export(1), released, r"row 1 holds no sequence")
    assert_refused(lambda: cache.export(2), cache, r"row must be an int in \[0, max_seqs=2\), got 2")
    assert_refused(lambda: jax.jit(lambda c: c.export(1).latent)(cache), cache, "PagedCache.export is an eager")


def test_load_refusals_name_the_field_and_change_nothing():
    exports, _, _, _ = reference("xla", "bfloat16")
    e = exports[0]  # 29 tokens: 4 pages of 8
    cache = gd.init_paged_cache(cfg(), 3, num_pages=6, page_size=8, dtype="bfloat16").load(0, exports[1])
    fp8 = gd.init_paged_cache(cfg(), 3, 8, 8, dtype="fp8", stage_dtype=jnp.float32)
    e8 = fields(e, latent=e.latent.astype(jnp.float8_e4m3fn), pooled=e.pooled.astype(jnp.float8_e4m3fn),
                latent_scale=np.ones(29, np.float32), pooled_scale=np.ones(7, np.float32))
    cases = [  # (target, row, export, message)
        (gd.init_paged_cache(tiny8(kv_lora_rank=24), 3, 8, 8, dtype="bfloat16"), 1, e,
         r"row 1: it differs from the cache in latent_width 40 \(the cache's: 24\)"),
        (gd.init_paged_cache(cfg(), 3, 8, 8, has_indexer=False, dtype="bfloat16"), 1, e,
         r"row 1: .*layer kind: the sequence has indexer state, the cache lacks it"),
        (cache, 1, fields(e, pooled=None, stage_keys=None, stage_gate=None, stage_from=None, kpool=None),
         r"layer kind: the sequence lacks indexer state, the cache has it"),
        (gd.init_paged_cache(tiny8(index_kpool=8), 3, 8, 8, dtype="bfloat16"), 1, e, r"kpool 4 \(the cache's: 8\)"),
        (fp8, 1, e, r"dtype bfloat16 \(the cache's: float8_e4m3fn\)"),
        (fp8, 1, e8, r"stage_dtype bfloat16 \(the cache's: float32\)"),
        (cache, 0, e, r"row 0: it is in use \(holds 18 tokens\)"),
        (cache, 3, e, r"row must be an int in \[0, max_seqs=3\), got 3"),
        (cache, -1, e, r"row must be an int in \[0, max_seqs=3\), got -1"),
        (gd.init_paged_cache(cfg(), 3, 8, 8, pages_per_seq=3, dtype="bfloat16"), 1, e,
         r"sequence of 29 tokens into row 1: more than pages_per_seq \* page_size = 24"),
        (cache, 1, e, r"sequence of 29 tokens into row 1: it needs 4 pages of 8 tokens but only 3 are "
                      r"free \(short by 1\)"),
        (cache, 1, {"latent": e.latent}, "expected an ExportedSequence"),
        (cache, 1, fields(e, pooled=e.pooled[:2]),
         r"ExportedSequence.pooled must be bfloat16 \(7, 16\) for a sequence of 29 tokens, got bfloat16 \(2, 16\)"),
        (cache, 1, fields(e, latent_scale=np.ones(29, np.float32)), r"ExportedSequence.latent_scale must be None"),
        (fp8, 1, fields(e8, pooled_scale=None), r"ExportedSequence.pooled_scale must be float32 \(7,\)"),
        (cache, 1, fields(e, kpool=None), r"ExportedSequence.kpool must be an int >= 1 \(the pool size\)"),
        (cache, 1, fields(e, stage_from=None), r"ExportedSequence.stage_from must be int32 \(\) for a sequence"),
        (cache, 1, fields(e, stage_from=np.int32(10)),
         r"ExportedSequence.stage_from = 10 but its stage of 4 entries holds positions 25 .. 28 only"),
    ]
    for target, row, exported, match in cases:
        assert_refused(lambda: target.load(row, exported), target, match)
    assert_refused(lambda: jax.jit(lambda c: c.load(1, exports[2]))(cache), cache, "PagedCache.load is an eager")
    cache.load(1, exports[1]).pages.check()  # what fits still loads


def test_too_few_free_pages_in_the_rows_data_shard():
    """Two data shards of 4 pages each (``Auto`` axes: the mesh tests above are ``Explicit``):
    a row is refused when its own shard lacks pages, whatever the other shard has; the
    decoder refuses before it donates anything."""
    exports, _, _, _ = reference("xla", "bfloat16")
    mesh = dp_mesh((2, 1), "auto")
    layer = sh.shard_layer(layer_of(), mesh, "tp", batch_axis="data")
    dec = gd.PagedDecoder(layer, 4, num_pages=8, page_size=8, pages_per_seq=8, cache_dtype="bfloat16")
    dec.load(0, exports[0])  # 4 pages: shard 0 is full
    assert np.asarray(dec.cache.pages.n_free).tolist() == [0, 4]
    assert_refused(lambda: dec.load(1, exports[1]), dec.cache,
                   r"row 1: it needs 3 pages of 8 tokens but only 0 are free in data shard 0 \(rows 0 .. 1\)")
    dec.load(3, exports[1])
    dec.cache.pages.check()
    assert np.asarray(dec.cache.pages.n_free).tolist() == [0, 1] and dec.lengths.tolist() == [29, 0, 0, 18]
