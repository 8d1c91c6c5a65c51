"""A compiled paged decode step writes its page pools in place: no whole-pool copy.

Why a test reads the HLO: a copy of a page pool costs the capacity, not the live tokens
(issue 10's step-time ratio), and timing cannot see it on a tiny pool. XLA rewrote the
one-row scatter of a batch-1 step into a ``dynamic-update-slice`` and XLA:CPU then kept
the old pool alive with four whole-pool copies per step (~400 ms against 6 ms at 131,072
tokens; see ``paged_cache._scatter_rows``).
"""

import math
import re

import jax.numpy as jnp
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.decode import make_step

_COPY = re.compile(r"= (\w+)\[([0-9,]*)\](?:\{[^}]*\})? copy\(")
_HLO_TYPE = {"uint16": "u16", "bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _pool_copies(hlo: str, pools) -> list[str]:
    """The ``copy`` instructions of ``hlo`` whose result has a pool's element type and
    element count (any shape: XLA copies reshaped views too)."""
    want = {(_HLO_TYPE[a.dtype.name], a.size) for a in pools}
    out = []
    for line in hlo.splitlines():
        m = _COPY.search(line)
        if m and (m.group(1), math.prod(int(d) for d in m.group(2).split(",") if d)) in want:
            out.append(line.strip()[:160])
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_paged_decode_step_copies_no_page_pool(batch):
    cfg = gd.DsaConfig.tiny()
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0))
    step, params = make_step(layer)
    cache = layer.init_paged_cache(batch, 24, 64)
    x = jnp.zeros((batch, 1, cfg.hidden_size), layer.dtype)
    hlo = step.lower(params, x, jnp.ones((batch, 1), bool), cache).compile().as_text()
    pools = (cache.latent_store, cache.pooled_store)
    # The pattern finds what jax 0.10 compiled before the fix (any view of a pool).
    seen = "%copy.20 = u16[24,64,40]{2,1,0} copy(%p)\n%copy.14 = u16[384,16]{1,0} copy(%b)"
    if cache.latent_store.dtype == jnp.uint16:
        assert len(_pool_copies(seen, pools)) == 2
    assert _pool_copies(hlo, pools) == []
