"""The caches of a DSA layer: the decode state a call reads and writes.

* ``contiguous``: ``DsaCache``, one timeline for the whole batch (HF's ``DynamicCache``);
* ``paged``: ``PagedCache``, a sequence per row in pages shared by every sequence (vLLM's
  and SGLang's layout), its page bookkeeping in ``pages``, shared prompt prefixes in ``fork``
  and drafts taken back in ``rollback``;
* ``transfer``: a paged sequence exported as host arrays (``ExportedSequence``) and loaded
  into a free row of another paged cache (serving moves paged sequences only);
* ``fp8``: e4m3 rows with a float32 scale per row, for either cache;
* ``interface``: what the layer's pipeline asks of a cache, the one place that documents
  it (``LayerCache``: begin a chunk, write the latent rows, the pool window and store, the
  live pools, the key source of index scoring, the rows attention reads and where, the
  tail, end the chunk). Both caches implement every operation, so the pipeline
  (``DsaAttention.forward``) is written once, with no branch on the cache's kind: the
  kind is decided here, by which class the cache is.

How a cache stores its buffers on a CPU (bits of 16-bit and fp8 floats) is
``glm5_dsa_jax.cpu_policy``'s; only this package reads the stored buffers.
"""

from glm5_dsa_jax.cache.contiguous import CACHE_DTYPES, DsaCache, check_cache_dtype, check_fits, init_cache
from glm5_dsa_jax.cache.interface import Chunk, LayerCache, PoolWindow
from glm5_dsa_jax.cache.paged import PagedCache, check_room, init_paged_cache
from glm5_dsa_jax.cache.transfer import ExportedSequence

__all__ = ["CACHE_DTYPES", "DsaCache", "PagedCache", "LayerCache", "Chunk", "PoolWindow",
           "init_cache", "init_paged_cache", "ExportedSequence", "check_cache_dtype", "check_fits", "check_room"]
