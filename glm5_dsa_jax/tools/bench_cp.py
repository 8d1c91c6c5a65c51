"""``glm5-dsa bench decode --cp N``: the sparse decode step with its cache split over a
sequence axis of ``N`` devices, against the same step on one device, in one run.

Context parallelism (``glm5_dsa_jax.parallel.context`` for the contiguous cache,
``glm5_dsa_jax.parallel.context_paged`` for the paged one), ``implementation="xla"`` only:
``glm5_dsa_jax.cli.bench`` refuses the Pallas implementations with ``--cp`` before any work.
On a CPU host the ``N`` devices are virtual (``glm5_dsa_jax.cli.host.need_devices``:
``jax_num_cpu_devices``, what ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` sets
before jax starts): they share the host's cores and memory, so the times say what the split
costs in work and collectives on this host, not what ``N`` accelerators would gain
(``glm5-dsa roofline --cp N`` models that).

For each batch size and context, two rows of the layer's jitted, cache-donating decode step
(``make_step``; the weights of one ``DsaAttention`` built from the same seed):

* ``cp=1``: the unsharded layer on one device, its cache on that device;
* ``cp=N``: the layer placed by ``shard_layer(layer, mesh, axis="tp", seq_axis="cp")`` on
  a ``(cp=N, tp=1)`` mesh, the same cache contents placed with its token rows and pools
  (contiguous) or its page pools (paged) split over ``cp`` (``sharding.place_cache``).

``cache="contiguous"``: ``bench.filled_cache`` (random rows and pooled keys, ``context``
valid tokens), capacity ``bench.default_capacity`` rounded up to a multiple of ``N *
index_kpool``. ``cache="paged"``: ``bench.filled_paged_cache`` (``bench.PAGE_SIZE``-token
pages, ``batch * capacity / PAGE_SIZE`` of them, each sequence's pages a random draw from
the pool, so they lie on the ``N`` devices unevenly, as after churn: every step is exact
wherever a page lives), capacity the default rounded up to a multiple of ``N * PAGE_SIZE``
(the pages divide by ``N`` at every batch size). Both rows of a kind share the capacity, so
each row replays one compilation across contexts (``compiles``). Before timing, one step of
each on the same inputs is compared: ``same_topk`` says whether the ``cp=N`` step selected
the same tokens bit for bit (it must: a ``False`` is a bug).

Per row: ``median_ms`` (``bench.time_steps``), ``devices`` (the step's), and per device:
``cache_bytes_per_device`` (the bytes of device 0's shards of the placed cache: ``1/N`` of
the token rows and pools, or of the page pools, plus the replicated stage and bookkeeping or
page table; ``memory_plan.cache_bytes(..., cp=N)``), ``read_bytes_per_device`` (the
roofline's floor, ``roofline.step_read_bytes``: every weight, in the dtype the step reads
it, plus ``1/N`` of the visible pooled keys plus the selected latent rows, all of them: the
worst case of the whole selection on one device) and ``crossing_bytes_per_device`` (what
each device sends per step, 0 at ``cp=1``: contiguous, ``roofline.cp_crossing_bytes``: the
candidates, the tail's validity and the partials; paged, ``paged_crossing_bytes``: the
candidates, ``K'`` of them a device as the paged step gathers them, and the partials; no
tail validity).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_dsa_jax.cache import check_cache_dtype
from glm5_dsa_jax.decode import make_step
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.parallel.sharding import batch_sharding, place_cache, shard_layer
from glm5_dsa_jax.tools.bench import PAGE_SIZE, default_capacity, filled_cache, filled_paged_cache, time_steps
from glm5_dsa_jax.tools.roofline import cp_crossing_bytes, step_read_bytes

__all__ = ["run", "cp_capacity", "device_bytes", "paged_crossing_bytes", "CP_CACHE_KINDS"]

#: The caches a ``--cp`` run splits.
CP_CACHE_KINDS = ("contiguous", "paged")


def cp_capacity(contexts: list[int], iters: int, cp: int, kpool: int, cache: str = "contiguous") -> int:
    """Cache slots per sequence for a ``cp`` run: ``bench.default_capacity`` rounded up to a
    multiple of ``cp * kpool`` (every device holds whole pools), or for a paged cache of
    ``cp * PAGE_SIZE`` (every sequence's pages, hence the pool's, divide by ``cp``)."""
    unit = cp * (PAGE_SIZE if cache == "paged" else kpool)
    return -(-default_capacity(contexts, iters, cache) // unit) * unit


def paged_crossing_bytes(cfg: DsaConfig, batch: int, cp: int, capacity: int) -> int:
    """Bytes one device sends per decode step of a paged cache split over ``cp`` devices
    (``parallel.context_paged``'s collectives, as a ring moves them): the candidates'
    all-gather, ``(cp - 1) * K' * 8`` a sequence with ``K' = min(select_k, PGL * PPP)`` (its
    static width: ``PGL = min(pages_per_seq, N / cp)`` pages of ``PPP`` pools), and the
    partials' ``psum`` / ``pmax`` as ``roofline.cp_crossing_bytes`` counts them; ``capacity``
    tokens a sequence, ``batch * capacity / PAGE_SIZE`` pages ``N``."""
    pps = capacity // PAGE_SIZE
    pgl = min(pps, batch * pps // cp)
    k_loc = min(cfg.select_k(pps * (PAGE_SIZE // cfg.index_kpool)), pgl * (PAGE_SIZE // cfg.index_kpool))
    return batch * (cp - 1) * k_loc * 8 + cp_crossing_bytes(cfg, capacity, batch, cp)["partials"]


def device_bytes(cache) -> int:
    """Bytes the first device holds of ``cache`` (its shard of every field)."""
    dev = jax.devices()[0]
    total = 0
    for a in jax.tree.leaves(cache):
        total += sum(s.data.nbytes for s in a.addressable_shards if s.device == dev)
    return total


def _crossing(cfg, cache, ctx, b, n, capacity) -> int:
    if n == 1:
        return 0
    return paged_crossing_bytes(cfg, b, n, capacity) if cache == "paged" else cp_crossing_bytes(cfg, ctx, b, n)["total"]


def _layer(cfg: DsaConfig, layer_idx: int, cp: int):
    layer = DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0), implementation="xla")
    if cp > 1:
        mesh = jax.make_mesh((cp, 1), ("cp", "tp"), devices=jax.devices()[:cp])
        shard_layer(layer, mesh, axis="tp", seq_axis="cp")
    return layer


def _cache(layer, b, ctx, capacity, dtype, kind):
    fill = filled_paged_cache if kind == "paged" else filled_cache
    kv = fill(layer, b, ctx, capacity, dtype=dtype)
    p = layer.placement
    return kv if p is None else place_cache(kv, p.mesh, None, p.seq_axis)


def run(preset: str, contexts: list[int], batches: list[int], iters: int, cp: int, log=print,
        cache_dtype: str | None = None, cache: str = "contiguous") -> dict:
    """The rows of the module doc, ``cp=1`` then ``cp=N`` per batch and context; ``cp`` at
    least 2 and at most the host's devices, ``cache`` in ``CP_CACHE_KINDS`` (``ValueError``
    otherwise)."""
    if cp < 2 or cp > len(jax.devices()):
        raise ValueError(f"cp must be in [2, {len(jax.devices())}] (this host's devices), got {cp}")
    if cache not in CP_CACHE_KINDS:
        raise ValueError(f"cache must be one of {CP_CACHE_KINDS}, got {cache!r}")
    cfg = DsaConfig.preset(preset)
    layer_idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i))
    capacity = cp_capacity(contexts, iters, cp, cfg.index_kpool, cache)
    layers = {n: _layer(cfg, layer_idx, n) for n in (1, cp)}
    steps = {n: make_step(layer) for n, layer in layers.items()}
    dtype = check_cache_dtype(layers[1].dtype if cache_dtype is None else cache_dtype)
    step1 = steps[1][0]
    def w_eb(n, b):  # bytes per weight as the step of ``n`` devices reads it at batch ``b``
        step, params = steps[n]
        return max(jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(step.compute_params(params, b)))

    rows = []
    for b in batches:
        x = jax.random.normal(jax.random.key(1), (b, 1, cfg.hidden_size), jnp.float32).astype(layers[1].dtype)
        mask = jnp.ones((b, 1), bool)
        traces0 = {n: s.traces for n, (s, _) in steps.items()}
        for ctx in contexts:
            topk = {}
            for n, layer in layers.items():
                step, params = steps[n]
                rows_at = (x, mask) if n == 1 else tuple(jax.device_put(a, batch_sharding(layer)) for a in (x, mask))
                topk[n] = jax.device_get(step(params, *rows_at, _cache(layer, b, ctx, capacity, dtype, cache))[1])
                kv = _cache(layer, b, ctx, capacity, dtype, cache)
                per_device = device_bytes(kv)
                ms = time_steps(lambda p, x, m, c: step(p, x, m, c), (params, *rows_at), kv, iters)
                floor = step_read_bytes(cfg, ctx, b, weight_elem_bytes=w_eb(n, b), cache_elem_bytes=dtype.itemsize)
                rows.append(dict(
                    impl="sparse", cp=n, devices=n, batch=b, context=ctx, median_ms=ms,
                    compiles=step.traces - traces0[n], cache=cache, capacity=capacity,
                    cache_dtype=dtype.name, cache_bytes_per_device=per_device,
                    read_bytes_per_device=floor["weights"] + floor["pooled"] // n + floor["latent"],
                    crossing_bytes_per_device=_crossing(cfg, cache, ctx, b, n, capacity)))
                log(f"sparse {cache} cp={n:<2} B={b:<2} ctx={ctx:<7} cap={capacity:<7} {ms:9.2f} ms  "
                    f"compiles={rows[-1]['compiles']}  cache/device {per_device / 1e6:.2f} MB")
            same = bool((topk[1] == topk[cp]).all())
            for r in rows[-2:]:
                r["same_topk"] = same
            if not same:
                log(f"cp={cp} B={b} ctx={ctx}: the top-k differs from cp=1 (a bug: it must not)")
    return {"rows": rows, "cp": cp, "preset": preset, "capacity": capacity, "cache": cache,
            "cache_dtype": dtype.name, "implementation": "xla", "device": str(jax.devices()[0].platform),
            "devices": len(jax.devices()), "float32_compute": bool(step1.float32)}
