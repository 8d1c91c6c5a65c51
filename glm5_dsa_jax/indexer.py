"""The lightning indexer's parameters and projections (``DsaIndexer``), replicated under TP.

The indexer emits a *selection*, not a partial sum, so it is replicated on every device of a
tensor-parallel mesh and computes the same top-k everywhere (``glm5_dsa_jax.parallel.placement``).
Its tensors are the layout table's indexer rows for the config's model type (k-pool gate
and APE only with k-pool compression, ``cfg.rules.kpool_compression``). The scoring,
selection and expansion steps that read what it projects are ``DsaAttention``'s methods.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_dsa_jax import layout
from glm5_dsa_jax.config import DsaConfig
from glm5_dsa_jax.ops import dense, layer_norm, matmul
from glm5_dsa_jax.param_init import ParamFactory
from glm5_dsa_jax.rope import apply_rope
from glm5_dsa_jax.steps import INDEX_PROJECT

__all__ = ["DsaIndexer"]


class DsaIndexer(nnx.Module):
    """The lightning indexer of one full DSA layer (replicated under TP).

    Parameters (the layout table's indexer rows, JAX layout): ``wq_b [q_lora, index_heads,
    D]``, ``wk [hidden, D]``, ``k_norm_scale/k_norm_bias [D]``, ``weights_proj [hidden,
    index_heads]``, ``kpool_gate [hidden, D]`` (HF ``index_kpool_compress_gate``
    transposed), ``kpool_ape [KP, D]``.
    """

    def __init__(self, cfg: DsaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.bfloat16, tp_axis="tp"):
        ParamFactory(cfg, rngs, param_dtype, tp_axis).create(
            self, [t for t in layout.layer_tensors(cfg, indexer=True) if t.indexer])
        self.cfg = cfg
        self.eps = cfg.index_norm_eps
        self.index_heads = cfg.index_n_heads

    def project(self, x: jax.Array, q_resid: jax.Array, rope=None):
        """``x [B, S, hidden]``, ``q_resid [B, S, q_lora]`` -> queries ``[B, S, Hi, D]``,
        weights ``[B, S, Hi]`` float32, keys ``[B, S, D]``, gate logits ``[B, S, D]`` float32.
        ``rope``: ``(cos, sin)`` at the tokens' positions (``rope.rope_cos_sin``) for a model
        whose indexer ropes the first ``qk_rope_head_dim`` channels of its queries and keys
        (in ``cfg.rules.indexer_rope_style``); keys are roped before they are pooled or
        cached, as HF caches them. Without k-pool compression the gate is zeros (a pool of
        one token is that token: ``kpool_compress`` then returns the keys exactly)."""
        cfg = self.cfg
        with jax.named_scope(INDEX_PROJECT):
            q = matmul("bsr,rhd->bshd", q_resid, self.wq_b[...])
            k = layer_norm(dense(x, self.wk[...]), self.k_norm_scale[...], self.k_norm_bias[...], self.eps)
            if rope is not None and cfg.rules.indexer_rope_style is not None:
                r, style = cfg.qk_rope_head_dim, cfg.rules.indexer_rope_style
                cos, sin = rope
                q = jnp.concatenate([apply_rope(q[..., :r], cos[:, :, None], sin[:, :, None], style), q[..., r:]], -1)
                k = jnp.concatenate([apply_rope(k[..., :r], cos, sin, style), k[..., r:]], -1)
            if cfg.rules.kpool_compression:
                gate = dense(x, self.kpool_gate[...]).astype(jnp.float32)
            else:
                gate = jnp.zeros(k.shape, jnp.float32)
            w = dense(x, self.weights_proj[...]).astype(jnp.float32) * (self.index_heads**-0.5)
        return q, w, k, gate

    def pool_ape(self, dtype) -> jax.Array:
        """``[KP, D]`` the k-pool APE (zeros without k-pool compression: KP is 1 there)."""
        if self.cfg.rules.kpool_compression:
            return self.kpool_ape[...]
        return jnp.zeros((self.cfg.index_kpool, self.cfg.index_head_dim), dtype)
