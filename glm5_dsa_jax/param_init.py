"""Creation of a layer's parameters from the layout table (``glm5_dsa_jax.layout``).

Why apart from the layer: the table says what each parameter is (path, shape, initialiser,
head axis); this module turns a row into an ``nnx.Param`` with its tensor-parallel
``out_sharding`` metadata, the only place that decides how a parameter is born.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_dsa_jax import layout
from glm5_dsa_jax.config import DsaConfig

__all__ = ["ParamFactory"]


def _mesh_has(axis: str | None) -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return axis is not None and not mesh.empty and axis in mesh.axis_names


class ParamFactory:
    """Makes the ``nnx.Param`` of a ``layout.Param`` row, with ``out_sharding`` metadata.

    The shape, initialiser and head axis come from the layout table. The metadata is kept
    even with no mesh in context (eager sharding is then switched off for the creation),
    so ``shard_layer`` or a user's ``nnx.get_partition_spec`` can place the parameters later.
    """

    def __init__(self, cfg: DsaConfig, rngs: nnx.Rngs, param_dtype, tp_axis: str | None):
        self.cfg, self.rngs, self.param_dtype, self.tp_axis = cfg, rngs, param_dtype, tp_axis

    def __call__(self, p: layout.Param) -> nnx.Param:
        shape = p.shape(self.cfg)
        if p.init == "ones":
            value = jnp.ones(shape, self.param_dtype)
        elif p.init == "zeros":
            value = jnp.zeros(shape, self.param_dtype)
        else:
            std = p.init_std(self.cfg)
            value = (jax.random.normal(self.rngs.params(), shape, jnp.float32) * std).astype(self.param_dtype)
        spec = p.spec(self.tp_axis)
        if _mesh_has(self.tp_axis):
            return nnx.Param(value, out_sharding=spec)
        with nnx.use_eager_sharding(False):
            return nnx.Param(value, out_sharding=spec)

    def create(self, module: nnx.Module, tensors) -> None:
        """Set ``module.<name>`` for every parameter of ``tensors`` (table order: the order
        the random inits are drawn in)."""
        for _, p in layout.iter_params(tensors):
            setattr(module, p.path[-1], self(p))
