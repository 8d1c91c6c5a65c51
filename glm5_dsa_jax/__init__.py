"""glm5-dsa-jax: the DeepSeek Sparse Attention (DSA) block of GLM-5.3-Flash in JAX.

Public API (see README.md)::

    import glm5_dsa_jax as gd
    cfg = gd.DsaConfig.from_hf_config("config.json")
    layer = gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0), implementation="xla")
    layer.load_hf_weights({...})
    out, topk = layer(hidden_states, attention_mask=mask)
    paged = layer.init_paged_cache(max_seqs=8, num_pages=1024)   # serving: a sequence per row
    out, topk, paged = layer(x, attention_mask=mask, cache=paged)
    fp8 = layer.init_cache(batch_size=8, max_length=32768, dtype="fp8")  # e4m3 rows, row scales
    gd.shard_layer(layer, jax.make_mesh((2, 4), ("data", "tp")), "tp", batch_axis="data")
    out, topk, loss = layer(x, attention_mask=mask, indexer_loss="dense")  # the indexer's loss
    nnx.Optimizer(layer, optax.adam(1e-3), wrt=gd.INDEXER_PARAMS)        # train the indexer alone
"""

from glm5_dsa_jax.cache import DsaCache, init_cache
from glm5_dsa_jax.checkpoint import (
    CheckpointError, load_hf_checkpoint, read_hf_params, restore_cache, restore_checkpoint, save_cache,
    save_checkpoint,
)
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.cache import PagedCache, init_paged_cache
from glm5_dsa_jax.decode import DsaDecoder, PagedDecoder, make_step
from glm5_dsa_jax.model.layout import hf_weight_shapes
from glm5_dsa_jax.tools.memory_plan import MemoryPlan
from glm5_dsa_jax.parallel.plan import TpPlan, partition_specs
from glm5_dsa_jax.parallel.sharding import shard_layer
from glm5_dsa_jax.model.layer import (
    DsaAttention, DsaIndexer, absorb_o, absorb_q, clear_float32_copies, float32_params,
)
from glm5_dsa_jax.model.weights import WeightError, hf_to_params, params_to_hf
from glm5_dsa_jax.model.indexer_loss import ATTENTION_PARAMS, INDEXER_PARAMS, indexer_param_mask

__all__ = [
    "CheckpointError", "load_hf_checkpoint", "read_hf_params", "restore_checkpoint", "save_checkpoint",
    "save_cache", "restore_cache", "DsaCache", "init_cache", "PagedCache", "init_paged_cache", "DsaDecoder", "PagedDecoder",
    "make_step", "DsaConfig", "DsaAttention", "DsaIndexer", "absorb_o", "absorb_q",
    "hf_weight_shapes", "float32_params", "clear_float32_copies",
    "TpPlan", "MemoryPlan", "partition_specs", "shard_layer", "WeightError", "hf_to_params", "params_to_hf",
    "INDEXER_PARAMS", "ATTENTION_PARAMS", "indexer_param_mask",
]
__version__ = "0.1.0"
