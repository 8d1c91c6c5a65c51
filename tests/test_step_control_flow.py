"""No control flow between the kernels of a decode step (issue 46).

A ``stablehlo.case`` (``lax.cond`` / ``lax.switch``) or ``stablehlo.while`` (``fori_loop``,
``while_loop``, ``scan``) in a GPU step is at least one more kernel and graph node a step,
and a conditional's predicate is read on the host. The GLM-5.3-Flash decode step
(``make_step``'s ``jax.jit``, ``implementation="pallas"``, a bf16 cache) is lowered for CUDA
without a GPU, as ``tests/test_context_parallel.py`` does (an abstract CUDA mesh,
``pk.cuda_mesh``; jax 0.10.2 lowers for CUDA without the CUDA plugin), at batch 1 / 4,096
and batch 8 / 131,072 tokens, contiguous and paged, and its module text is searched for
those ops. The Pallas kernels are custom calls whose Triton IR is serialized bytecode in an
``ir = "..."`` attribute (``_outside_kernels`` drops those strings anyway), so every op
found is between the kernels.

Before issue 46 each step held 4 conditionals and 1 loop (contiguous: the row writes' and
the pool writes' ``lax.cond``, the pool writes' ``fori_loop``, the short-context
``lax.cond``) or 2 and 1 (paged: the short-context ``cond``, the page-table check's
``cond`` on shared pages, ``reserve``'s ``scan``). Left: the check's ``cond`` on shared
pages in the paged step (``cache.pages``' module doc: it skips a sort of the block table,
which no row needs unless it shares a page), within ``MAX_CONTROL_OPS``.

The contiguous cache's writes must stay in place as they lost their ``cond``: the step
compiled for this CPU copies or converts no whole cache buffer (``test_fp8_cache``'s check
for fp8 buffers, here for bf16 ones at batch 1 and 3: a chain of one-row updates of the
pooled keys was copied whole twice a step at batch 3, the scatter that replaced it is not).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import use_abstract_mesh

import glm5_dsa_jax as gd
import pallas_kernels as pk
from glm5_dsa_jax.decode import make_step

pytestmark = pytest.mark.lowering

#: ``stablehlo.case`` / ``stablehlo.while`` ops a decode step may hold outside its kernels.
MAX_CONTROL_OPS = 1

_CONTROL = re.compile(r'"?stablehlo\.(case|while)\b')
_KERNEL_IR = re.compile(r'\bir = "(?:[^"\\]|\\.)*"')

CASES = [(1, 4096, "contiguous"), (1, 4096, "paged"), (8, 131072, "contiguous"), (8, 131072, "paged")]


def _outside_kernels(text: str) -> str:
    """``text`` without the kernels' serialized IR strings."""
    return _KERNEL_IR.sub('ir = ""', text)


def control_ops(text: str) -> list[str]:
    """The ``case`` / ``while`` ops of a lowered module's text, outside the kernels."""
    return [m.group(1) for m in _CONTROL.finditer(_outside_kernels(text))]


def lowered_decode_step(batch: int, context: int, cache_kind: str, page: int = 64) -> str:
    """The GLM-5.3-Flash decode step (its first DSA layer, ``"pallas"``, bf16) on a
    ``context``-token cache a row (paged: ``batch * context / page`` pages of ``page``),
    lowered for CUDA without a GPU; the module's text."""
    cfg = gd.DsaConfig.glm53_flash()
    idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i))
    layer = nnx.eval_shape(lambda: gd.DsaAttention(cfg, idx, rngs=nnx.Rngs(0), implementation="pallas"))
    if cache_kind == "paged":
        cache = jax.eval_shape(lambda: gd.init_paged_cache(cfg, batch, batch * context // page, page,
                                                           has_indexer=True, dtype=jnp.bfloat16))
    else:
        cache = jax.eval_shape(lambda: gd.init_cache(cfg, batch, context, has_indexer=True, dtype=jnp.bfloat16))
    step, params = make_step(layer)
    x = jax.ShapeDtypeStruct((batch, 1, cfg.hidden_size), jnp.bfloat16)
    m = jax.ShapeDtypeStruct((batch, 1), jnp.bool_)
    with use_abstract_mesh(pk.cuda_mesh("h100", (1,), ("x",))):
        # What the step reads for one row (abstract parameters: the GPU product policy's
        # contraction-last copies, ``cpu_policy``).
        lowered = step.jitted(cache).trace(step.compute_params(params, batch), x, m, cache, None).lower(
            lowering_platforms=("cuda",))
    return lowered.as_text()


def test_the_count_sees_control_flow_and_skips_kernel_ir():
    """The checker finds a ``lax.cond`` and a ``fori_loop`` lowered for CUDA, and nothing in
    a kernel's serialized IR."""
    def f(x, p):
        y = jax.lax.cond(p, lambda v: v + 1, lambda v: v - 1, x)
        return jax.lax.fori_loop(0, x.shape[0], lambda i, v: v * 2, y)

    with use_abstract_mesh(pk.cuda_mesh("h100", (1,), ("x",))):
        text = jax.jit(f).lower(jnp.ones(4), True).as_text()
    assert sorted(control_ops(text)) == ["case", "while"]
    assert control_ops('%0 = stablehlo.custom_call @k() {ir = "stablehlo.case \\" stablehlo.while"}') == []


@pytest.mark.parametrize("batch, context, cache_kind", CASES, ids=[f"b{b}-{c}-{k}" for b, c, k in CASES])
def test_decode_step_has_no_control_flow_between_kernels(batch, context, cache_kind):
    text = lowered_decode_step(batch, context, cache_kind)
    assert "xla.gpu.triton" in text  # the Pallas kernels are there, as custom calls
    ops = control_ops(text)
    assert len(ops) <= MAX_CONTROL_OPS, (
        f"{len(ops)} case/while ops outside the kernels ({ops}); at most {MAX_CONTROL_OPS}")
    if cache_kind == "contiguous":
        assert ops == []


_WHOLE = re.compile(r"= (\w+)\[([0-9,]*)\](?:\{[^}]*\})? (copy|convert)\(")


@pytest.mark.parametrize("batch", [1, 3])
def test_contiguous_decode_step_writes_in_place(batch):
    """The compiled CPU step copies or converts no whole cache buffer (a capacity whose
    element counts no other tensor of the step has)."""
    cfg = gd.DsaConfig.tiny()
    layer = gd.DsaAttention(cfg, 1, rngs=nnx.Rngs(0))
    step, params = make_step(layer)
    cache = layer.init_cache(batch, 1000)
    x = jnp.zeros((batch, 1, cfg.hidden_size), layer.dtype)
    hlo = step.lower(params, x, jnp.ones((batch, 1), bool), cache).compile().as_text()
    sizes = {a.size for a in (cache.latent_store, cache.pooled_store, cache.key_valid, cache.pool_valid)}
    whole = [line.strip()[:160] for line in hlo.splitlines()
             if (m := _WHOLE.search(line)) and math.prod(int(d) for d in m.group(2).split(",") if d) in sizes]
    assert whole == []
