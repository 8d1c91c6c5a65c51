"""Peak memory per device of a prefill chunk under context parallelism, against the unsharded
layer: XLA's memory analysis of the compiled step, no run.

``prefill_memory`` (and ``python scripts/cp_prefill_memory.py --context 1048576 --chunk 4096
--cp 1,2,8``, which prints its rows) compiles
``make_step``'s jitted call of one DSA layer (GLM-5.3-Flash by default, bf16 weights and
cache, one sequence, ``"xla"``) for a ``chunk``-token prefill chunk on a cache of
``context`` slots, once per ``cp``: ``cp = 1`` the unsharded layer on one device, else the
layer placed by ``shard_layer(..., axis="tp", seq_axis="cp")`` on a ``(cp, 1)`` mesh with its
cache split over ``cp``. Everything is abstract (``nnx.eval_shape``, ``ShapeDtypeStruct``
inputs carrying their shardings), so a 1M-token cache costs no host memory; on a CPU host the
``cp`` devices are virtual (the script makes them: ``cli.host.need_devices``).

Per row, per device (the partitioned program's): ``argument_bytes`` (the weights and the
cache shard), ``output_bytes``, ``temp_bytes`` (XLA's temporaries: the score tiles, the
chunk's projections) and ``alias_bytes`` (the donated cache), and which selection the chunk
ran (``parallel.context.splits_queries``: the query split or the key split). What it says is
the program's memory on the platform it compiles for (a CPU here: float32 products of the
projections, ``cpu_policy``); docs/parallelism.md quotes one run.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from glm5_dsa_jax.cache.contiguous import init_cache, pool_row_bytes
from glm5_dsa_jax.decode import make_step
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.parallel import context as cpx
from glm5_dsa_jax.parallel import sharding as sh
from glm5_dsa_jax.parallel.placement import Placement

__all__ = ["prefill_memory"]


def prefill_memory(config, context: int, chunk: int, cp: int, devices=None) -> dict:
    """The memory analysis (module doc) of a ``chunk``-token prefill chunk of ``config``'s
    first DSA layer on a ``context``-slot cache, unsharded (``cp = 1``) or split over ``cp``
    of ``devices`` (default ``jax.devices()``): ``{"context", "chunk", "cp",
    "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "selection"}``."""
    idx = next(i for i in config.dsa_layers if config.has_indexer(i))
    layer = nnx.eval_shape(lambda: DsaAttention(config, idx, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    cache = jax.eval_shape(lambda: init_cache(config, 1, context, has_indexer=True, dtype=jnp.bfloat16))
    placed = contextlib.nullcontext()
    kw = {}
    if cp > 1:
        devices = (jax.devices() if devices is None else devices)[:cp]
        mesh = jax.make_mesh((cp, 1), ("cp", "tp"), axis_types=(AxisType.Explicit,) * 2, devices=devices)
        layer.placement = Placement(mesh, "tp", None, "cp")
        kw = dict(sharding=NamedSharding(mesh, P()))
        placed = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    step, params = make_step(layer)
    if cp > 1:
        params, cache = sh.abstract_step_operands(layer, params, cache)
    else:  # what the unplaced step reads (abstract parameters: the GPU product policy's copies)
        params = step.compute_params(params, chunk)
    x = jax.ShapeDtypeStruct((1, chunk, config.hidden_size), jnp.bfloat16, **kw)
    mask = jax.ShapeDtypeStruct((1, chunk), jnp.bool_, **kw)
    with placed:
        compiled = step.jitted(cache).trace(params, x, mask, cache, None).lower().compile()
    ma = compiled.memory_analysis()
    p_loc = cache.max_pools // cp
    split = cpx.splits_queries(chunk, cp, config.select_k(cache.max_pools), p_loc, pool_row_bytes(cache))
    return dict(context=context, chunk=chunk, cp=cp, argument_bytes=int(ma.argument_size_in_bytes),
                output_bytes=int(ma.output_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes),
                alias_bytes=int(ma.alias_size_in_bytes),
                selection="unsharded" if cp == 1 else ("query split" if split else "key split"))
