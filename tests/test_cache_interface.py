"""The cache interface (``glm5_dsa_jax.cache.interface``): both caches implement every
operation with the interface's signature, the pipeline asks no cache its kind, and the one
tile scorer reads either key source as the scoring kernels do."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.cache import DsaCache, LayerCache, PagedCache
from glm5_dsa_jax.cache.interface import OPERATIONS, tile_scorer
from helpers import F32_REORDER, padded_batch, tiny8

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glm5_dsa_jax"
KIND_CHECK = re.compile(r"isinstance\([^)]*(PagedCache|DsaCache)")
#: Modules outside the cache package that still ask a cache its kind, and why (an entry
#: no longer needed fails, so the list stays true).


@pytest.mark.parametrize("cls", [DsaCache, PagedCache])
def test_every_operation_is_implemented(cls):
    for name in OPERATIONS:
        assert hasattr(cls, name), f"{cls.__name__} lacks the interface operation {name}"
        want = getattr(LayerCache, name, None)
        if inspect.isfunction(want):
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(inspect.signature(want).parameters), f"{cls.__name__}.{name}"
    # Every operation the protocol declares is in OPERATIONS (the list the check walks).
    declared = {n for n in vars(LayerCache) if not n.startswith("_")} | set(LayerCache.__annotations__)
    assert declared <= set(OPERATIONS), sorted(declared - set(OPERATIONS))


def test_the_pipeline_asks_no_cache_its_kind():
    src = inspect.getsource(gd.DsaAttention.forward)
    assert "isinstance" not in src and "PagedCache" not in src and "DsaCache" not in src
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] != "cache" and KIND_CHECK.search(path.read_text()):
            found[str(rel)] = True
    assert not found, f"isinstance on a cache kind in {sorted(found)}"


def test_no_stored_buffer_outside_the_cache_package():
    # The bit storage (cpu_policy) is read only by the cache package.
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "cache" or rel.name == "cpu_policy.py":
            continue
        text = path.read_text()
        for word in ("from_store", "to_store", "latent_store", "pooled_store"):
            assert word not in text, f"{rel} names {word}"


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_tile_scorer_reads_either_key_source_as_the_kernel(kind):
    # A prefill fills the pools; the streaming selection's tile scorer over every pool
    # (two tiles) gives the whole-row kernel's scores on either cache kind: the same
    # candidates (-inf where not) and values up to the order of float32 sums (op by op
    # here, fused in the kernel's program).
    cfg = tiny8()
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0))
    x, mask = padded_batch(cfg, [3, 0], 13, 0)
    cache = layer.init_cache(2, 16) if kind == "contiguous" else layer.init_paged_cache(2, 4, 8)
    _, _, cache = layer(x, attention_mask=mask, cache=cache)
    keys = cache.pool_keys()
    rng = np.random.default_rng(1)
    qi = jnp.asarray(rng.standard_normal((2, 1, cfg.index_n_heads, cfg.index_head_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 1, cfg.index_n_heads)), jnp.float32)
    q_pos = jnp.asarray([[12], [12]] if kind == "contiguous" else [[9], [12]], jnp.int32)
    whole = keys.kernel(qi, w, *keys.operands(), q_pos, keys.scale, kpool=cfg.index_kpool)
    tile = cache.max_pools // 2
    score = tile_scorer(tile, cfg.index_kpool)
    tiles = [score(jnp.int32(t * tile), qi, w, q_pos, keys) for t in range(2)]
    got, want = np.asarray(jnp.concatenate(tiles, -1)), np.asarray(whole)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, rtol=F32_REORDER, atol=F32_REORDER)
    assert np.isfinite(np.asarray(whole)).any()  # some pool is a candidate: the check bites
    assert cache.live_pools(q_pos).shape == q_pos.shape
