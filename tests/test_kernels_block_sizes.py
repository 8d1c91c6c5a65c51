"""The one kernel API: every wrapper takes ``implementation`` (an ``Implementation``) and
``block_sizes`` (its kernel's frozen dataclass), and a bad block size is refused whatever
runs (``"xla"`` included), with a ``ValueError`` naming the dataclass field.

Also: the defaults resolve to the sizes the kernels launched with before the dataclasses
existed (so no tiling, and no number, changed), and the modules do not share their public
functions' names (``import pallas_kernels.selection`` gives a module).
"""

from __future__ import annotations

import dataclasses
import typing

import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import _common


def _kpool(impl, bs):
    return pk.kpool_compress(jnp.zeros((1, 8, 4)), jnp.zeros((1, 8, 4)), jnp.ones((1, 8), bool),
                             jnp.zeros((2, 4)), implementation=impl, block_sizes=bs)


def _scores(impl, bs):
    return pk.index_scores(jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 2, 2)), jnp.zeros((1, 4, 4)),
                           jnp.ones((1, 4), bool), jnp.zeros((1,), jnp.int32),
                           jnp.zeros((1, 2), jnp.int32), kpool=2, implementation=impl,
                           block_sizes=bs)


def _scores_paged(impl, bs):
    return pk.index_scores_paged(jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 2, 2)),
                                 jnp.zeros((3, 2, 4)), jnp.zeros((1, 2), jnp.int32),
                                 jnp.ones((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                                 kpool=2, implementation=impl, block_sizes=bs)


def _topk(impl, bs):
    return pk.topk_pools(jnp.zeros((1, 1, 8)), 2, implementation=impl, block_sizes=bs)


def _expand(impl, bs):
    return pk.expand_selection(jnp.zeros((1, 2, 3), jnp.int32), jnp.zeros((1,), jnp.int32), None,
                               kpool=2, out_width=8, implementation=impl, block_sizes=bs)


def _attend(impl, bs):
    return pk.sparse_mla(jnp.zeros((1, 1, 4, 16)), jnp.zeros((1, 8, 16)),
                         jnp.zeros((1, 1, 4), jnp.int32), scale=1.0, implementation=impl,
                         block_sizes=bs)


# (dataclass, the wrapper call, one bad value per field)
KERNELS = [
    (pk.KpoolCompressBlockSizes, _kpool, dict(block_pools=3, num_warps=6, num_stages=0)),
    (pk.IndexScoresBlockSizes, _scores, dict(block_q=3, block_p=8, num_warps=0, num_stages=-1)),
    (pk.IndexScoresBlockSizes, _scores_paged, dict(block_q=3, block_p=8, num_warps=0,
                                                   num_stages=-1)),
    (pk.TopkPoolsBlockSizes, _topk,
     dict(block_p=1000, radix_bits=16, split_p=3, num_warps=5, num_stages=0)),
    (pk.ExpandSelectionBlockSizes, _expand, dict(block_q=0, block_w=12, num_warps=3,
                                                 num_stages=True)),
    (pk.SparseMlaBlockSizes, _attend, dict(block_h=8, block_w=24, block_c=48, num_splits=0,
                                           num_warps=3, num_stages=0)),
]
CASES = [pytest.param(cls, call, field, value, id=f"{call.__name__[1:]}-{cls.__name__}.{field}")
         for cls, call, bad in KERNELS for field, value in bad.items()]


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("cls, call, field, value", CASES)
def test_bad_block_size_is_refused_under_every_implementation(cls, call, field, value, impl):
    assert field in {f.name for f in dataclasses.fields(cls)}
    bs = cls(**{field: value})
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}\b"):
        call(impl, bs)
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}\b"):
        bs.validate()


@pytest.mark.parametrize("cls, call", [(cls, call) for cls, call, _ in KERNELS],
                         ids=[call.__name__[1:] for _, call, _ in KERNELS])
def test_defaults_run_and_the_dataclass_is_frozen_and_typed(cls, call):
    for bs in (None, cls()):
        call("xla", bs)
        call("pallas_interpret", bs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls().num_warps = 8
    hash(cls())  # usable as a static (jit) argument
    with pytest.raises(TypeError, match=cls.__name__):
        call("xla", {"num_warps": 4})  # one convention: the dataclass, not a dict


def test_defaults_resolve_to_the_kernels_former_tiling():
    # kpool_compress: min(next_pow2(P), 4096 // D_pad); 32 pools at D = 128.
    assert pk.KpoolCompressBlockSizes().resolve(1025, 128).block_pools == 32
    assert pk.KpoolCompressBlockSizes().resolve(3, 5).block_pools == 4
    assert pk.KpoolCompressBlockSizes(block_pools=2).resolve(1025, 128).block_pools == 2
    # index_scores: 16 queries x 64 pools, capped at the padded problem.
    assert pk.IndexScoresBlockSizes().resolve(1, 32768) == pk.IndexScoresBlockSizes(
        block_q=1, block_p=64)
    assert pk.IndexScoresBlockSizes().resolve(64, 3).block_p == 16
    # topk_pools: block_p 1024 (256 at radix_bits 8), split_p 2048, four segments or more
    # take the multi-program path.
    tk = pk.TopkPoolsBlockSizes()
    assert (tk.radix_bits, tk.split_p, tk.num_warps, tk.num_stages) == (4, 2048, 8, 2)  # 8 warps: no spill
    assert tk.resolve(262144).block_p == 1024 and tk.resolve(40).block_p == 64
    assert pk.TopkPoolsBlockSizes(radix_bits=8).resolve(262144).block_p == 256
    assert not tk.multi_program(8191) and tk.multi_program(8192)
    assert (tk.programs_per_row(8191), tk.programs_per_row(262144)) == (1, 128)
    # expand_selection: 4 rows x 512 ids, capped.
    assert pk.ExpandSelectionBlockSizes().resolve(1, 8195, 2051) == pk.ExpandSelectionBlockSizes(
        block_q=1, block_w=512)
    # sparse_mla: 16 heads, 32 ids (16 for rows narrower than 17), C = 512 in one chunk,
    # splits for about 256 programs.
    sm = pk.SparseMlaBlockSizes().resolve((1, 1, 64, 512), 2051)
    assert (sm.block_h, sm.block_w, sm.block_c, sm.num_splits) == (16, 32, 512, 16)
    assert pk.SparseMlaBlockSizes().resolve((1, 64, 64, 512), 2051).num_splits == 1
    assert pk.SparseMlaBlockSizes().resolve((1, 1, 4, 16), 4).block_w == 16


def test_implementation_type_and_check():
    assert typing.get_args(pk.Implementation) == pk.IMPLEMENTATIONS == (
        "xla", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret", "auto")
    assert _common.check_implementation("pallas") == "pallas"
    with pytest.raises(ValueError, match="implementation must be one of"):
        _common.check_implementation("triton")
    for fn in (pk.kpool_compress, pk.index_scores, pk.index_scores_paged, pk.topk_pools,
               pk.expand_selection, pk.sparse_mla):
        hints = typing.get_type_hints(fn)
        assert hints["implementation"] == pk.Implementation, fn.__name__
        assert "block_sizes" in hints, fn.__name__
