"""``glm5-dsa bench decode``: decode-step time of sparse DSA against dense absorbed MLA.

A benchmark, not a test: ``run`` returns the rows and ``glm5_dsa_jax.cli.bench`` prints
them (a table, or one JSON object with ``--json``). For each batch size and context length
it builds a cache already holding ``context`` tokens per sequence (random latent rows and
pooled keys: prefilling 131,072 tokens at the real dims would take hours on a CPU, and the
step's cost does not depend on the values), then times

* ``sparse``: the whole jitted, cache-donating decode step of one full DSA layer
  (projections, pool update, index scores, top-k, expansion, sparse MLA, ``o_proj``), on
  the cache kind ``run``'s ``cache`` names: ``"contiguous"`` (``init_cache``,
  ``filled_cache``) or ``"paged"`` (``init_paged_cache`` with ``max_seqs = batch``,
  ``PAGE_SIZE``-token pages and ``batch * capacity / PAGE_SIZE`` pages, each sequence's
  pages a random draw from the pool: ``filled_paged_cache``);
* ``dense``: the same step with attention over every cached token instead of the selection
  (the indexer skipped), i.e. absorbed MLA without DSA, on a contiguous cache of the same
  capacity as the sparse row's (masked attention over every slot of it, as a fixed-shape
  compiled step must), in the sparse step's arithmetic (``dense_mla_decode``: bf16 products
  into float32, as the ``"xla"`` ``sparse_mla``; not the float32 oracle
  ``mla_masked_attention``, about 3x slower on a CPU);
* ``dense_fit``: dense's best case, a cache sized to the context (so it re-compiles per
  context, where the sparse step replays one compilation);
* ``sparse_attn`` / ``dense_attn`` (contiguous cache only): the attention part alone
  (the layer's steps 2-5, selection + sparse MLA as its decode step runs them, against
  ``dense_mla_decode`` over all tokens), given the absorbed queries; ``index``: the indexer alone, the layer's steps 2-3 as its decode step runs them
  (``DsaAttention.choose_pools``: scores over the live pools and the top-k, or the short
  path), given its queries and head weights. A paged run has no such rows: its selection reads through the block table
  inside the layer's paged call, and the whole ``sparse`` step is what it measures.

and, at batch 1 and contexts up to ``--hf-max-context``, ``hf``: Hugging Face's eager
``Glm5NextTextAttention`` (bf16) stepping one token on a ``DynamicCache`` already holding
``context`` tokens (random latent rows and indexer keys), when ``transformers`` is
installed.

Rows that are compared with each other are timed in rounds, one call of each in turn
(``_time_rounds``), so that a burst of the shared machine's noise falls on all of them: a
batch's ``sparse`` rows over its contexts (``time_steps_rounds``; every context's cache is
held until then), and a context's ``sparse_attn`` and ``index`` rows. A context's
``dense_attn`` row is timed on its own, before them: XLA frees a call's scratch after its
result is ready, and the dense call's gigabytes of scratch (at 131K, batch 8) freed while the
next call ran made that call 4-5x slower.

Per row: the median step time, the number of compilations (1 means the step replayed
without re-tracing as the context moved), the peak bytes XLA reports for the compiled
step (arguments + outputs + scratch, minus donated aliases), the cache kind (``cache``:
``"contiguous"`` or ``"paged"``; ``"dynamic"`` for HF's growing ``DynamicCache``) and its
``capacity`` in tokens per sequence (``run``'s ``capacity``, default the largest context
plus the timed steps, rounded up to whole pages for a paged run; the context the cache is
sized to for ``dense_fit``; the context for HF). A paged cache of capacity ``T`` holds
exactly the tokens a contiguous one of ``T`` slots per sequence does (``T / PAGE_SIZE``
pages per sequence, ``batch`` times that in the pool), so the two kinds' rows compare
like for like. ``cache_bytes_per_token`` is the sparse row's cache size divided by its
batch size and capacity (block tables and free stack included for a paged cache). Each row
names its cache dtype (``cache_dtype``): ``run``'s ``cache_dtype`` (``--cache-dtype fp8``)
applies to the sparse rows (and ``sparse_attn``); the dense rows stay bf16, the baseline
an fp8 cache is measured against.

The floor counts bytes and FLOPs: ``floor_bytes`` is what the row must read at least
(``roofline.step_read_bytes``: every weight once, in the dtype the step reads it, i.e. on a
CPU the bf16 contraction-last copies, ``cpu_policy``, float32 copies only where the step
multiplies those; the pooled keys of the visible pools and the selected latent rows; dense
rows: the non-indexer weights and every cached latent row; ``index``: the visible pooled
keys) and ``floor_flops``
what it must compute at least (``roofline.step_flops``: every projection, the index scores
where the selection matters, the attention over the selected tokens; dense rows: the
non-indexer projections and attention over every cached token; the attention-part rows
without the projections; ``index``: the index scores alone, none where every pool is
selected, so that row has no floor). Both are timed against the device's rates
(``timing.device_rates``, ``rates_source``): on a CPU measured in the same run,
``read_gb_s`` a jitted sum over 512 MiB of float32 and ``matmul_gflop_s`` a jitted
1,024-square matmul in each dtype the rows' products run in (``{"float32": ...,
"bfloat16": ...}``; on a CPU with AMX the bf16 one is ~5x the float32 one), each the best
of several, what the machine can do rather than its noise; on a GPU the roofline table's
HBM bandwidth and bf16 rate for that GPU (a float32 rate measured on an 8,192-square
product; a GPU the table does not name: a 4 GiB copy and that product), so no row reads
under x1 (the first H200 run's ``jnp.sum`` reached 1.9 of 4.8 TB/s). A row's FLOPs are timed at
the rate of its products' dtype (``floor_matmul_dtype``): bf16 for the attention-part rows
(``sparse_attn``, ``index``, ``dense_attn``: bf16 rows into a float32 accumulator; float32
for an fp8 cache) and for whole steps (contraction-last bf16 projections; float32 where
the step reads float32 copies). ``floor_read_ms``
and ``floor_compute_ms`` are the two parts, ``floor_ms`` the larger (``floor_limit`` says
which), and ``x_floor`` the row's time over it: as ``glm5-dsa roofline`` bounds a kernel on
a GPU. HF rows carry no floor (HF re-expands the latent cache through ``kv_b_proj`` every
step; its floor is not the same fact).

On a GPU (``loop_steps``, ``--loop-steps``) the whole-step rows (``sparse``, ``dense``,
``dense_fit``) also carry ``loop_ms``: one step inside a jitted program of ``loop_steps``
steps and twice as many, the cache threaded (``timing.step_loop_ms``), the device's time
without the host's (None where the machine's noise exceeded the steps), and
``x_floor_loop`` its ratio to the floor; ``median_ms`` over it is the host's share of a call.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from pallas_kernels.attention import weighted_values
from pallas_kernels.dense_mla import masked_softmax
from glm5_dsa_jax.cache import PagedCache, check_cache_dtype
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.decode import make_step
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.tools.roofline import step_flops, step_read_bytes, weight_bytes
from glm5_dsa_jax.tools.timing import device_rates, read_bandwidth, step_loop_ms

#: Tokens per page of a paged run (vLLM's and SGLang's page size).
PAGE_SIZE = 64
#: ``run``'s cache kinds.
CACHE_KINDS = ("contiguous", "paged")

__all__ = ["filled_cache", "filled_paged_cache", "run", "default_capacity", "check_capacity",
           "time_steps", "time_steps_rounds", "read_bandwidth", "dense_mla_decode", "PAGE_SIZE",
           "CACHE_KINDS"]


def filled_cache(layer: DsaAttention, batch: int, context: int, max_length: int, seed: int = 0,
                 dtype=None):
    """A cache holding ``context`` valid tokens of random content, room for ``max_length``
    (``dtype``: the cache dtype, default the layer's; an fp8 cache quantises the rows as
    its writes do)."""
    cfg = layer.cfg
    cache = layer.init_cache(batch, max_length, dtype=dtype)
    k1, k2 = jax.random.split(jax.random.key(seed))
    dt = jnp.float32 if cache.is_fp8 else cache.dtype  # float rows; replace() quantises fp8
    latent = jax.random.normal(k1, (batch, max_length, cfg.kv_cache_dim), jnp.float32).astype(dt)
    valid = jnp.arange(max_length)[None] < context
    n_pools = context // cfg.index_kpool
    pooled = jax.random.normal(k2, (batch, cache.max_pools, cfg.index_head_dim), jnp.float32).astype(dt)
    pool_valid = jnp.broadcast_to(jnp.arange(cache.max_pools)[None] < n_pools, cache.pool_valid.shape)
    # The stage holds slots context-H .. context-1: valid wherever they exist.
    h = cache.stage_width
    stage_valid = jnp.broadcast_to(context - h + jnp.arange(h) >= 0, cache.stage_valid.shape)
    return cache.replace(
        latent=jnp.where(valid[..., None], latent, 0).astype(dt),
        key_valid=jnp.broadcast_to(valid, cache.key_valid.shape),
        length=jnp.asarray(context, jnp.int32),
        pooled=jnp.where(pool_valid[..., None], pooled, 0).astype(dt),
        pool_valid=pool_valid,
        stage_valid=stage_valid,
        first_key=jnp.zeros((batch,), jnp.int32),
        n_valid=jnp.full((batch,), context, jnp.int32),
    )


def filled_paged_cache(layer: DsaAttention, batch: int, context: int, capacity: int,
                       page_size: int = PAGE_SIZE, seed: int = 0, dtype=None) -> PagedCache:
    """A paged cache of ``batch`` sequences holding ``context`` tokens each of random
    content, room for ``capacity`` tokens per sequence: ``capacity / page_size`` pages per
    sequence and ``batch`` times that in the pool (``capacity`` a multiple of
    ``page_size``, else ``ValueError``).

    Written straight into the pages, as ``filled_cache`` writes the contiguous one: every
    page holds random latent rows and pooled keys (rows past a sequence's length are never
    read: every read is bounded by ``lengths``), each sequence owns the first
    ``ceil(context / page_size)`` pages of a random permutation of the pool (so its pages
    are scattered, as after sequences came and went), the rest are on the free stack, and
    the stage holds random keys and gate logits for positions ``context - KP ..
    context - 1``. The bookkeeping passes ``cache.pages.check()``. ``dtype``: the cache
    dtype (default the layer's; fp8 rows are quantised with their scales)."""
    if capacity % page_size:
        raise ValueError(f"capacity must be a multiple of page_size={page_size} for a paged "
                         f"cache, got {capacity}")
    if not 0 <= context <= capacity:
        raise ValueError(f"context must be in [0, capacity={capacity}], got {context}")
    pps = capacity // page_size
    n = batch * pps
    cache = layer.init_paged_cache(batch, n, page_size, pages_per_seq=pps, dtype=dtype)
    used = -(-context // page_size)
    perm = np.random.default_rng(seed).permutation(n).astype(np.int32)
    table = np.full((batch, pps), -1, np.int32)
    table[:, :used] = perm[: batch * used].reshape(batch, used)
    n_free = n - batch * used
    # free[:n_free] are the free pages; the entries above the top are unspecified.
    free = np.concatenate([perm[batch * used:], perm[: batch * used]])
    owner = np.full(n, -1, np.int32)  # pages.PageTable.owner: the row holding each page
    owner[table[:, :used]] = np.arange(batch, dtype=np.int32)[:, None]
    pages = cache.pages.replace(
        block_table=jnp.asarray(table), lengths=jnp.full((batch,), context, jnp.int32),
        free=jnp.asarray(free), n_free=jnp.asarray(n_free, jnp.int32), owner=jnp.asarray(owner),
        refs=jnp.asarray((owner >= 0).astype(np.int32)))
    # Random float rows (float32 for fp8: replace() quantises them, with their scales).
    dt = jnp.float32 if cache.is_fp8 else cache.dtype
    cfg = layer.cfg
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    upd = dict(pages=pages, latent=jax.random.normal(k1, (n, page_size, cfg.kv_cache_dim), dt))
    if cache.has_indexer:
        kp, h = cache.kpool, cache.stage_width
        # The stage is right-aligned: entry i holds position context - H + i (none if < 0).
        held = (context - h + jnp.arange(h) >= 0)[None, :, None]
        sdt = cache.stage_keys.dtype
        upd.update(
            pooled=jax.random.normal(k2, (n, page_size // kp, cfg.index_head_dim), dt),
            stage_keys=jnp.where(held, jax.random.normal(k3, cache.stage_keys.shape, sdt), 0).astype(sdt),
            stage_gate=jnp.where(held, jax.random.normal(k4, cache.stage_gate.shape, jnp.float32), 0.0))
    return cache.replace(**upd)


def _peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    if m is None:
        return -1
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def time_steps(step, args, cache, iters: int, warmup: int = 1) -> float:
    """Median milliseconds of ``step(*args, cache)``, threading the donated cache through
    (each step appends one token, so the context grows by ``iters + warmup``)."""
    return time_steps_rounds(step, args, [cache], iters, warmup)[0]


def time_steps_rounds(step, args, caches: list, iters: int, warmup: int = 1) -> list[float]:
    """``time_steps`` of every cache in ``caches`` (one compiled ``step``), timed in rounds:
    each round steps every cache once, in turn, so a burst of the machine's noise falls on
    all of them alike and their ratios (``step(131,072) / step(4,096)``) compare like with
    like. Each cache is threaded through its own donated steps."""
    state = list(caches)

    def stepper(j):
        def call():
            res = step(*args, state[j])
            jax.block_until_ready(res)
            state[j] = res[-1]
        return call

    return _time_rounds([stepper(j) for j in range(len(state))], iters, warmup)


def _time_rounds(calls, iters: int, warmup: int = 1) -> list[float]:
    """Median milliseconds of each of ``calls`` (no-argument callables that block until
    their work is done), timed in ``warmup + iters`` rounds of one call each, in turn; the
    first ``warmup`` rounds are not counted."""
    times = [[] for _ in calls]
    for i in range(warmup + iters):
        for call, t in zip(calls, times):
            t0 = time.perf_counter()
            call()
            if i >= warmup:
                t.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def dense_mla_decode(q_lat, latent, mask, *, scale: float) -> jax.Array:
    """The dense rows' attention: absorbed MLA of one query per row ``q_lat [B, 1, H, C]``
    over every row of ``latent [B, L, C]`` allowed by ``mask [B, 1, L]`` -> ``[B, 1, H, C]``,
    in the arithmetic of the sparse step's ``"xla"`` ``sparse_mla`` (its reference), without
    the gather: bf16 rows and queries multiplied into a float32 accumulator, the float32
    softmax weights' value sum by ``weighted_values``. Other dtypes: ``mla_masked_attention``.

    Why not ``pk.mla_masked_attention``: that oracle converts every row to float32 first and
    multiplies at HIGHEST precision, which XLA:CPU runs about 3x slower than bf16 products
    (batch 8, 4,096 rows: 103.5 against 37.5 ms in one run, 2026-12-03); against the sparse
    step's bf16 products that is not like for like. Outputs: bit for bit ``sparse_mla``'s
    given every allowed row as its ids (tested), within bf16 rounding of the oracle's."""
    if not (q_lat.dtype == latent.dtype == jnp.bfloat16) or q_lat.shape[1] != 1:
        return pk.mla_masked_attention(q_lat, latent, mask, scale=scale)
    # One batch axis (``B``): XLA:CPU keeps such 16-bit products 16-bit (see
    # ``pallas_kernels.attention._flat_batch_product``).
    s = jnp.einsum("bhc,blc->bhl", q_lat[:, 0], latent, preferred_element_type=jnp.float32)
    p = masked_softmax(s[:, None] * scale, mask[:, :, None, :])
    return weighted_values(p, latent[:, None]).astype(q_lat.dtype)


def _dense_layer_step(layer: DsaAttention, step):
    """The decode step with dense absorbed MLA over all cached tokens (no indexer), with the
    products ``step`` (``make_step``'s) uses for as many rows (``step.products``; on a CPU
    contraction-last copies, ``cpu_policy``).
    ``(jitted step, params_for(rows), traces)``."""
    params = nnx.state(layer)
    traces = {"n": 0}

    def step_fn(params, x, cache):
        traces["n"] += 1
        m = step.module(params)  # a GPU's joined copies hold the indexer's weights too: 16 of 250 MB read
        cfg = m.cfg
        rows = x.shape[0] * x.shape[1]
        with step.products(rows):
            _, q_lat, latent = m.project(x)
        pos = cache.length
        cache, chunk = cache.begin_chunk(jnp.ones(x.shape[:2], bool))
        cache = cache.write_latent(latent, chunk)
        lat, _ = cache.attention_rows()
        mask = cache.key_valid[:, None, :] & (jnp.arange(lat.shape[1]) <= pos)[None, None, :]
        o = dense_mla_decode(q_lat, lat, mask, scale=cfg.softmax_scale)
        with step.products(rows):
            out = m.output_projection(o)
        return out, cache.end_chunk(chunk)

    return (jax.jit(step_fn, donate_argnames=("cache",)),
            lambda rows: step.compute_params(params, rows), traces)


def _hf_step_ms(cfg: DsaConfig, layer_idx: int, context: int, iters: int, seed: int = 0):
    """Median ms of HF's eager ``Glm5NextTextAttention`` (bf16, batch 1) stepping one token
    on a ``DynamicCache`` pre-filled with ``context`` random tokens; None without
    ``transformers``."""
    try:
        import torch
        from transformers import DynamicCache
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention
    except ImportError:
        return None
    d = cfg.to_hf_dict()
    d.pop("model_type", None)
    hf_cfg = Glm5NextTextConfig(**d)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = Glm5NextTextAttention(hf_cfg, layer_idx).to(torch.bfloat16).eval()
    cache = DynamicCache(config=hf_cfg)
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    with torch.no_grad():
        lat = torch.randn(1, 1, context, cfg.kv_lora_rank, generator=g).to(bf)
        cache.update(lat, torch.zeros(1, 1, context, cfg.qk_rope_head_dim, dtype=bf), layer_idx)
        d_i = cfg.index_head_dim
        packed = torch.cat([torch.randn(1, context, 2 * d_i, generator=g),
                            torch.ones(1, context, 1)], dim=-1).to(bf)
        cache.update_indexer(packed, layer_idx)
        x = torch.randn(1, 1, cfg.hidden_size, generator=g).to(bf)
        mask = torch.ones(1, 1, dtype=torch.bool)
        times = []
        for i in range(iters + 1):
            t0 = time.perf_counter()
            attn(hidden_states=x, attention_mask=mask, past_key_values=cache)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def default_capacity(contexts: list[int], iters: int, cache: str = "contiguous") -> int:
    """Cache slots per sequence when none is given: the largest context plus room for the
    warm-up and timed steps (each appends one token), rounded up to whole ``PAGE_SIZE``
    pages for a paged cache."""
    need = max(contexts) + iters + 2
    return -(-need // PAGE_SIZE) * PAGE_SIZE if cache == "paged" else need


def check_capacity(capacity: int, contexts: list[int], iters: int, cache: str = "contiguous") -> None:
    """``ValueError`` unless ``cache`` is one of ``CACHE_KINDS`` and a cache of
    ``capacity`` tokens per sequence holds the largest context and the ``iters + 1`` steps
    appended to it (in whole ``PAGE_SIZE`` pages for a paged cache)."""
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, got {cache!r}")
    need = max(contexts) + iters + 1
    if capacity < need:
        raise ValueError(
            f"capacity {capacity} cannot hold context {max(contexts)} plus {iters + 1} decode "
            f"steps: need at least {need} tokens"
        )
    if cache == "paged" and capacity % PAGE_SIZE:
        raise ValueError(
            f"capacity {capacity} is not a whole number of {PAGE_SIZE}-token pages: a paged "
            f"cache needs a multiple of {PAGE_SIZE} (e.g. {-(-capacity // PAGE_SIZE) * PAGE_SIZE})"
        )


def run(preset: str, contexts: list[int], batches: list[int], iters: int, implementation: str,
        log=print, hf_max_context: int = 16384, capacity: int | list[int] | None = None,
        cache: str = "contiguous", cache_dtype: str | None = None, loop_steps: int | None = None) -> dict:
    """The benchmark's rows (see the module doc); ``loop_steps``: the whole-step rows'
    in-loop column (``loop_ms``: one step inside a program of ``loop_steps`` and twice as
    many, ``timing.step_loop_ms``, the steps chained by their cache; None: 8 on a GPU, none
    on a CPU);
    ``capacity``: cache slots per sequence of
    the sparse, dense and attention rows (None: ``default_capacity``), or a list of them:
    then every context's sparse row is timed at each capacity, all of a batch's sparse rows
    in one set of rounds (what a capacity costs at the same live tokens, e.g. ``[4224,
    131072]`` at context 4,096: issue 48's check), and the other rows use the first;
    ``cache``: the sparse rows' cache kind, ``"contiguous"`` or ``"paged"``; ``cache_dtype``:
    the sparse and attention rows' cache dtype (None: the layer's, bf16; ``"fp8"``). The
    dense rows keep a bf16 cache: they are the baseline."""
    if capacity is None:
        capacity = default_capacity(contexts, iters, cache)
    capacities = [capacity] if isinstance(capacity, int) else list(capacity)
    for cap in capacities:
        check_capacity(cap, contexts, iters, cache)
    capacity = capacities[0]
    paged = cache == "paged"
    fill = filled_paged_cache if paged else filled_cache
    cfg = DsaConfig.preset(preset)
    layer_idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i))
    layer = DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0), implementation=implementation)
    step, params = make_step(layer)
    dense_step, dense_params_for, dense_traces = _dense_layer_step(layer, step)

    def w_eb(b):  # bytes per weight as the step of batch ``b`` reads it (float32 copies: 4)
        return max(jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(step.compute_params(params, b)))

    cache_dtype = check_cache_dtype(layer.dtype if cache_dtype is None else cache_dtype)
    # Floors count the rows' own bytes (an fp8 row's 4-byte scale, < 1 %, is not counted).
    cache_eb, dense_eb = cache_dtype.itemsize, jnp.dtype(layer.dtype).itemsize
    # The read rate and the rate of each dtype a row's products run in (``product_dtype``):
    # measured on a CPU, the roofline table's on a GPU it names (``timing.device_rates``).
    machine = device_rates({jnp.dtype(jnp.float32), jnp.dtype(layer.dtype)})
    bw, rates = machine.bandwidth, machine.flops

    def weight_dtype(b):  # the dtype the step of batch ``b`` multiplies its weights in
        return "float32" if w_eb(b) == 4 else jnp.dtype(layer.dtype).name

    log(f"read bandwidth {bw / 1e9:.2f} GB/s; matmul "
        + ", ".join(f"{r / 1e9:.1f} GFLOP/s ({d})" for d, r in rates.items())
        + f" ({machine.source}); step weights {weight_bytes(cfg, w_eb(1)) / 1e6:.1f} MB at one row "
        f"({weight_dtype(1)})")

    def product_dtype(impl, b):
        """The dtype a row's products run in: the attention part's are the cache rows' (bf16
        products into float32; an fp8 cache's in float32), a whole step's are its
        projections' (``make_step``: on a CPU contraction-last bf16 copies; float32 copies
        where it reads those), whose weights dominate it."""
        if impl in ("sparse_attn", "index", "dense_attn"):
            dt = jnp.dtype(layer.dtype if impl == "dense_attn" else cache_dtype)
            return dt.name if dt.itemsize == 2 else "float32"
        return weight_dtype(b)

    def floor(impl, b, ctx):
        if impl == "sparse":
            n = step_read_bytes(cfg, ctx, b, weight_elem_bytes=w_eb(b), cache_elem_bytes=cache_eb)["total"]
            f = step_flops(cfg, ctx, b)["total"]
        elif impl in ("dense", "dense_fit"):
            n = weight_bytes(cfg, w_eb(b), has_indexer=False) + b * ctx * cfg.kv_cache_dim * dense_eb
            f = step_flops(cfg, ctx, b, dense=True)["total"]
        elif impl == "sparse_attn":
            n = step_read_bytes(cfg, ctx, b, cache_elem_bytes=cache_eb)["cache"]
            fl = step_flops(cfg, ctx, b)
            f = fl["index"] + fl["attention"]
        elif impl == "index":
            f = step_flops(cfg, ctx, b)["index"]
            if not f:  # every pool is selected: nothing to score or read, no floor
                return {}
            n = step_read_bytes(cfg, ctx, b, cache_elem_bytes=cache_eb)["pooled"]
        elif impl == "dense_attn":
            n = b * ctx * cfg.kv_cache_dim * dense_eb
            f = step_flops(cfg, ctx, b, dense=True)["attention"]
        else:
            return {}
        dt = product_dtype(impl, b)
        read_ms, compute_ms = n / bw * 1e3, f / rates[dt] * 1e3
        return dict(floor_bytes=int(n), floor_flops=int(f), floor_matmul_dtype=dt, floor_read_ms=read_ms,
                    floor_compute_ms=compute_ms,
                    floor_ms=max(read_ms, compute_ms), floor_limit="memory" if read_ms >= compute_ms else "compute")

    rows = []
    key = jax.random.key(1)
    bytes_per_token = None
    for b in batches:
        # One cache size for every context, so every context replays the same compiled step.
        max_length = capacity
        x = jax.random.normal(key, (b, 1, cfg.hidden_size), jnp.float32).astype(layer.dtype)
        mask = jnp.ones((b, 1), bool)
        traces0, dense_compiles = step.traces, {}
        step_peak = {cap: _peak_bytes(step.lower(params, x, mask, jax.eval_shape(
            lambda: fill(layer, b, contexts[0], cap, dtype=cache_dtype))).compile()) for cap in capacities}
        sparse_caches = []  # every (context, capacity)'s, held until the sparse rows are timed together
        for ctx in contexts:
            kv = fill(layer, b, ctx, max_length, dtype=cache_dtype)
            if bytes_per_token is None:
                bytes_per_token = kv.nbytes() / (b * max_length)
            if not paged:  # dense attention over a bf16 cache of the same tokens: the baseline
                dense_kv = filled_cache(layer, b, ctx, max_length) if kv.is_fp8 else kv
                rows.extend(_attention_rows(layer, kv, dense_kv, b, ctx, iters, log, max_length))
                del dense_kv
            # Dense on the sparse row's capacity (one compilation across contexts), then
            # its best case, a cache sized to this context (a compilation per context).
            for impl, cap in (("dense", max_length), ("dense_fit", ctx + iters + 2)):
                n0 = dense_traces["n"]
                dcache = filled_cache(layer, b, ctx, cap)
                dense_params = dense_params_for(b)
                dense_peak = _peak_bytes(dense_step.lower(dense_params, x, dcache).compile())
                t_dense = time_steps(dense_step, (dense_params, x), dcache, iters)
                del dense_params
                del dcache
                # dense: compilations so far at this batch's capacity; dense_fit: this one's.
                dense_compiles[impl] = dense_compiles.get(impl, 0) + dense_traces["n"] - n0
                compiles = dense_compiles[impl] if impl == "dense" else dense_traces["n"] - n0
                rows.append(dict(impl=impl, batch=b, context=ctx, median_ms=t_dense,
                                 compiles=compiles, peak_bytes=dense_peak, cache="contiguous",
                                 capacity=cap, cache_dtype=jnp.dtype(layer.dtype).name))
                log(f"{impl:<9} B={b:<2} ctx={ctx:<7} cap={cap:<7} {t_dense:9.2f} ms  "
                    f"compiles={compiles}")
            sparse_caches.append(((ctx, max_length), kv))
            del kv
            sparse_caches += [((ctx, cap), fill(layer, b, ctx, cap, dtype=cache_dtype)) for cap in capacities[1:]]
        # The sparse rows of every context (and capacity) in rounds (``time_steps_rounds``):
        # the ratio of two contexts' steps is not the noise between two moments of the run.
        keys = [k for k, _ in sparse_caches]
        t_sparse = time_steps_rounds(lambda p, x, m, c: step(p, x, m, c), (params, x, mask),
                                     [c for _, c in sparse_caches], iters)
        del sparse_caches
        for (ctx, cap), t in zip(keys, t_sparse):
            rows.append(dict(impl="sparse", batch=b, context=ctx, median_ms=t,
                             compiles=step.traces - traces0, peak_bytes=step_peak[cap],
                             cache=cache, capacity=cap, cache_dtype=cache_dtype.name))
            log(f"sparse    B={b:<2} ctx={ctx:<7} cap={cap:<7} {t:9.2f} ms  "
                f"compiles={step.traces - traces0}  ({cache} {cache_dtype.name} cache)")
        if b == 1:
            for ctx in [c for c in contexts if c <= hf_max_context]:
                t_hf = _hf_step_ms(cfg, layer_idx, ctx, iters)
                if t_hf is None:
                    log("hf      skipped: transformers (torch) is not installed")
                    break
                rows.append(dict(impl="hf", batch=1, context=ctx, median_ms=t_hf, compiles=0, peak_bytes=-1,
                                 cache_dtype="bfloat16",
                                 cache="dynamic", capacity=ctx))
                log(f"hf      B=1  ctx={ctx:<7} {t_hf:9.2f} ms  (eager Glm5NextTextAttention, bf16)")
    if loop_steps is None:
        loop_steps = 8 if jax.default_backend() == "gpu" else 0
    for r in rows if loop_steps else ():
        if r["impl"] in ("sparse", "dense", "dense_fit") and r["cache"] == "contiguous":
            r["loop_ms"] = _loop_ms(layer, step, params, dense_step, dense_params_for, r, loop_steps, cache_dtype)
            log(f"{r['impl']:<9} B={r['batch']:<2} ctx={r['context']:<7} in loop {r['loop_ms'] or float('nan'):9.3f} ms")
    for r in rows:
        r.update(floor(r["impl"], r["batch"], r["context"]))
        if "floor_ms" in r:
            r["x_floor"] = r["median_ms"] / r["floor_ms"]
            if "loop_ms" in r:
                r["x_floor_loop"] = None if r["loop_ms"] is None else r["loop_ms"] / r["floor_ms"]
    return {"rows": rows, "cache_bytes_per_token": bytes_per_token, "preset": preset, "capacity": capacity,
            "capacities": capacities,
            "cache": cache, "cache_dtype": cache_dtype.name,
            "implementation": implementation, "device": str(jax.devices()[0].platform),
            "read_gb_s": bw / 1e9, "matmul_gflop_s": {d: r / 1e9 for d, r in rates.items()},
            "rates_source": machine.source,
            "float32_compute": any(w_eb(b) == 4 for b in batches),  # a step read float32 copies
            "weight_bytes_step": {b: weight_bytes(cfg, w_eb(b)) for b in batches},
            "weight_bytes_stored": weight_bytes(cfg, jnp.dtype(layer.param_dtype).itemsize)}


def _loop_ms(layer, step, params, dense_step, dense_params_for, row, n: int, cache_dtype) -> float | None:
    """A whole-step row's ``loop_ms``: its step inside one program (``timing.step_loop_ms``,
    ``n`` steps; None where the machine's noise exceeded them), on a cache of its context with room for the program's steps (its own
    compilation: the in-loop column does not change the per-call rows')."""
    b, ctx = row["batch"], row["context"]
    cap = ctx + 3 * n * 4 + 8
    x = jax.random.normal(jax.random.key(1), (b, 1, layer.cfg.hidden_size), jnp.float32).astype(layer.dtype)
    if row["impl"] == "sparse":
        kv = filled_cache(layer, b, ctx, cap, dtype=cache_dtype)
        ms, _ = step_loop_ms(step.jitted(kv), step.compute_params(params, b), x, jnp.ones((b, 1), bool), kv, n)
        return ms
    as_step = lambda p, h, _m, c: (lambda o, c2: (o, None, c2))(*dense_step(p, h, c))  # noqa: E731
    ms, _ = step_loop_ms(as_step, dense_params_for(b), x, None, filled_cache(layer, b, ctx, cap), n)
    return ms


def _attention_rows(layer, cache, dense_cache, b, ctx, iters, log, capacity):
    """The attention part alone: selection + sparse MLA on ``cache``, against dense masked
    MLA on ``dense_cache`` (the same tokens; bf16 when ``cache`` is fp8)."""
    cfg = layer.cfg
    impl = layer.implementation
    k = jax.random.key(2)
    q_lat = jax.random.normal(k, (b, 1, cfg.num_attention_heads, cfg.kv_lora_rank)).astype(layer.dtype)
    qi = jax.random.normal(k, (b, 1, cfg.index_n_heads, cfg.index_head_dim)).astype(layer.dtype)
    w = jax.random.normal(k, (b, 1, cfg.index_n_heads), jnp.float32)
    pos = jnp.full((b, 1), ctx - 1, jnp.int32)
    n_vis = jnp.full((b, 1), ctx, jnp.int32)
    select_k = cfg.select_k(cache.max_pools)

    @jax.jit
    def sparse(q_lat, qi, w, cache):
        # The layer's own steps 2-5, as its decode step runs them.
        pools = layer.choose_pools(qi, w, cache, pos, select_k)
        ids = layer.expand_to_tokens(pools, cache, n_vis, pos)
        return layer.sparse_attention(q_lat, cache.latent, ids, cache.latent_scale)

    @jax.jit
    def dense(q_lat, cache):
        # Over exactly the ``ctx`` cached tokens: dense attention's best case.
        mask = cache.key_valid[:, None, :ctx]
        return dense_mla_decode(q_lat, cache.latent[:, :ctx], mask, scale=cfg.softmax_scale)

    @jax.jit
    def index(qi, w, cache):
        # The layer's own steps 2-3 (as its decode step runs them: live pools only).
        return layer.choose_pools(qi, w, cache, pos, select_k)

    # Dense attention first, on its own; then the sparse part and the indexer in rounds
    # (``_time_rounds``), whose untimed warm-up round absorbs the dense call's teardown. Not
    # all three in rounds: at 131K and batch 8 the dense call's scratch is large (gigabytes
    # with the float32 oracle it ran before ``dense_mla_decode``; hundreds of MB now), and
    # XLA's worker threads free it after its result is ready, while the next call runs; in
    # rounds, the call after it measured 110-120 ms where alone it takes 20-25 ms (the
    # teardown took ~120 ms of this process's CPU after each dense call, oracle era).
    (td,) = _time_rounds([lambda: jax.block_until_ready(dense(q_lat, dense_cache))], iters)
    ts, ti = _time_rounds([lambda: jax.block_until_ready(sparse(q_lat, qi, w, cache)),
                           lambda: jax.block_until_ready(index(qi, w, cache))], iters)
    log(f"attn    B={b:<2} ctx={ctx:<7} sparse {ts:9.2f} ms  dense {td:9.2f} ms  ({td / ts:.1f}x)  "
        f"index {ti:9.2f} ms")
    common = dict(batch=b, context=ctx, compiles=1, peak_bytes=-1, cache="contiguous", capacity=capacity)
    return [dict(impl="sparse_attn", median_ms=ts, cache_dtype=cache.dtype.name, **common),
            dict(impl="dense_attn", median_ms=td, cache_dtype=dense_cache.dtype.name, **common),
            dict(impl="index", median_ms=ti, cache_dtype=cache.dtype.name, **common)]
