"""A compiled paged decode step costs what its live tokens need, not its page pool.

Issue 48: a pool sized for 131,072 tokens a sequence stepped x1.5 slower at batch 8 than one
sized for 4,224, at the same 4,096 live tokens: every step's page-table check sorted each
row's whole block table (``[max_seqs, pages_per_seq]``), and the ``"xla"`` selection's
larger score tile was sized by the pool (``min(POOL_TILE, max_pools)``), so the compiled step
differed with the capacity. Timing cannot see this on a tiny pool, and a test should not
time anything: this one reads XLA's cost analysis of the compiled step at two pool sizes.

What may still grow with the pool: the page table is validated, not trusted (a caller may
write any entry, ``cache.pages``' module doc), and a check that refuses a broken entry
wherever it lies reads every entry. That check is a few elementwise int32 passes over the
table and the free stack (no sort unless some row shares a page, no scan), bounded here at
``FLOPS_PER_PAGE`` per page; the pools themselves are written in place (their scatters are
the rows written, ``tests/test_paged_pool_copies.py``).
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import make_step

#: FLOPs per page of pool (and its block-table entry) the step may add: the page table's
#: elementwise checks and updates (~250 on jax 0.10), far below what a sort of the block
#: table or a score tile sized by the pool costs (thousands a page).
FLOPS_PER_PAGE = 400
PAGE_SIZE = 16


def _step_flops(layer, step, params, batch: int, pages_per_seq: int) -> float:
    cache = jax.eval_shape(lambda: layer.init_paged_cache(batch, batch * pages_per_seq, PAGE_SIZE,
                                                          pages_per_seq=pages_per_seq))
    x = jax.ShapeDtypeStruct((batch, 1, layer.cfg.hidden_size), layer.dtype)
    m = jax.ShapeDtypeStruct((batch, 1), jnp.bool_)
    cost = step.lower(params, x, m, cache).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("batch", [1, 4])
def test_paged_decode_step_flops_do_not_follow_the_pool(batch):
    cfg = gd.DsaConfig.tiny(index_topk=64)  # 16 pools selected: a 4K context is scored
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0))
    step, params = make_step(layer)
    small, large = 8, 256  # pages per sequence: 128 and 4,096 tokens
    f_small = _step_flops(layer, step, params, batch, small)
    f_large = _step_flops(layer, step, params, batch, large)
    per_page = (f_large - f_small) / (batch * (large - small))
    assert per_page <= FLOPS_PER_PAGE, (
        f"the compiled step's FLOPs grow by {per_page:.0f} per page of pool ({f_small:,.0f} at "
        f"{small} pages a sequence, {f_large:,.0f} at {large}): work that follows the pool")
