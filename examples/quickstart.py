"""Quick start: one DSA layer of the tiny preset, end to end, on a CPU in seconds.

    python examples/quickstart.py

1. the config and which of its layers are DSA layers (a "full" one with its own indexer,
   a "shared" one reusing the full layer's top-k);
2. a left-padded prompt through both layers, no cache;
3. prefill then decode on a contiguous cache, jitted (``DsaDecoder``);
4. serving: a paged cache, one sequence per row, sequences joining and leaving
   (``PagedDecoder``);
5. tensor parallelism: the same layer with its heads split over a 2-device ``tp`` mesh,
   then a ``data x tp`` mesh, on virtual CPU devices. Same top-k, same outputs.

Random weights (``layer.load_hf_weights`` or ``gd.load_hf_checkpoint`` load real ones: see
docs/checkpoints.md). Every step checks what it prints, so the script fails loudly if the
library stops doing what it shows.
"""

import os

# 8 virtual CPU devices for the meshes of step 5. Set before jax is imported: the flag is
# read once, when the CPU backend starts.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this script runs on the CPU even where a GPU is

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import glm5_dsa_jax as gd

# ---------------------------------------------------------------- 1. config and layers
cfg = gd.DsaConfig.preset("tiny")  # 4 layers, hidden 48, 4 heads, index_topk 16, kpool 4
full_idx, shared_idx = cfg.dsa_layers  # the DSA layers: (1, 2)
assert cfg.has_indexer(full_idx) and not cfg.has_indexer(shared_idx)
print(f"tiny preset: layer_types {cfg.layer_types}")
print(f"  DSA layers {cfg.dsa_layers}: layer {full_idx} is 'full' (own indexer), "
      f"layer {shared_idx} is 'shared' (reuses layer {full_idx}'s top-k)")

# float32 keeps the tiny demo exact; real models use the default bfloat16.
kw = dict(implementation="xla", dtype=jnp.float32, param_dtype=jnp.float32)
layer = gd.DsaAttention(cfg, full_idx, rngs=nnx.Rngs(0), **kw)
shared = gd.DsaAttention(cfg, shared_idx, rngs=nnx.Rngs(1), **kw)

# ---------------------------------------------------------------- 2. a padded prompt, no cache
rng = np.random.default_rng(0)
B, S = 2, 40
x = jnp.asarray(rng.standard_normal((B, S, cfg.hidden_size)), jnp.float32)
mask = np.ones((B, S), bool)
mask[1, :9] = False  # row 1 is left padded: 31 tokens
mask = jnp.asarray(mask)



# A call is `layer(x, attention_mask=mask)`; eager works too, but one compiled program is
# quicker than op-by-op dispatch (a few seconds of compilation against ~10 on a CPU).
@nnx.jit
def forward(layer, x, mask, prev_topk=None):
    return layer(x, attention_mask=mask, prev_topk=prev_topk)


out, topk = forward(layer, x, mask)  # out [B, S, hidden], topk [B, S, out_width] token ids
out2, _ = forward(shared, out, mask, topk)  # the shared layer attends to the same tokens
print(f"\nno cache: out {out.shape}, topk {topk.shape} (out_width {cfg.out_width} = "
      f"{cfg.index_topk} selected tokens + a tail of {cfg.out_width - cfg.index_topk})")
last = np.asarray(topk[0, -1])
print(f"  row 0, last query: attends {int((last >= 0).sum())} of {S} tokens: {last[last >= 0].tolist()}")
assert (np.asarray(topk[1, :9]) == -1).all()  # padding queries select nothing

# ---------------------------------------------------------------- 3. prefill + decode, jitted
# (a model runs one decoder per DSA layer; a shared layer's gets `prev_topk=t` each call)
dec = gd.DsaDecoder(layer, batch_size=B, max_length=64)  # a contiguous cache of 64 slots
o, t = dec(x, mask)  # prefill (any chunk length, in as many chunks as you like)
np.testing.assert_allclose(o, out, rtol=1e-5, atol=1e-5)  # the same as the call without a cache
for _ in range(8):  # decode: one token per row per step, one compiled program
    h = jnp.asarray(rng.standard_normal((B, 1, cfg.hidden_size)), jnp.float32)
    o, t = dec(h, jnp.ones((B, 1), bool))
print(f"\ncontiguous cache: {dec.length} of {dec.max_length} slots used, "
      f"decode step compiled {dec.step.traces - 1} time(s) after the prefill")

# ---------------------------------------------------------------- 4. serving: a paged cache
# 4 sequences share 12 pages of 16 tokens; row b of every call is sequence b.
pdec = gd.PagedDecoder(layer, max_seqs=4, num_pages=12, page_size=16)
xs = jnp.asarray(rng.standard_normal((4, 24, cfg.hidden_size)), jnp.float32)
join = jnp.asarray(np.arange(24)[None] < np.array([24, 10, 0, 0])[:, None])  # rows 0, 1 join
pdec(xs, join)  # prefill of two sequences of their own lengths
for _ in range(4):  # decode the live rows, a new sequence joins row 2 meanwhile
    step = jnp.asarray([[True], [True], [True], [False]])
    pdec(xs[:, :1], step)
print(f"\npaged cache: sequence lengths {pdec.lengths.tolist()}, "
      f"{int(pdec.cache.pages.n_free.sum())} of 12 pages free")
pdec.release(jnp.asarray([True, False, False, False]))  # sequence 0 is done: its pages return
print(f"  after release of row 0: lengths {pdec.lengths.tolist()}, "
      f"{int(pdec.cache.pages.n_free.sum())} pages free")
assert pdec.lengths.tolist() == [0, 14, 4, 0]

# ---------------------------------------------------------------- 5. tensor parallelism
# The tiny preset has 4 heads: a tp axis of 1, 2 or 4 devices (not 8).
mesh = jax.make_mesh((2,), ("tp",))
tp_layer = gd.DsaAttention(cfg, full_idx, rngs=nnx.Rngs(0), **kw)  # same seed: same weights
gd.shard_layer(tp_layer, mesh, axis="tp")  # heads split over tp, the indexer replicated
out_tp, topk_tp = forward(tp_layer, x, mask)
assert (np.asarray(topk_tp) == np.asarray(topk)).all()  # the same selection, bit for bit
np.testing.assert_allclose(out_tp, out, rtol=1e-5, atol=1e-5)
print(f"\nTP 2: q_b_proj {tp_layer.q_b_proj[...].shape} sharded as "
      f"{tp_layer.q_b_proj[...].sharding.spec}; same top-k and outputs as one device")

# data x tp: the batch (and the caches' sequences) split over "data", heads over "tp".
mesh2 = jax.make_mesh((2, 2), ("data", "tp"))
dp_layer = gd.DsaAttention(cfg, full_idx, rngs=nnx.Rngs(0), **kw)
gd.shard_layer(dp_layer, mesh2, axis="tp", batch_axis="data")
out_dp, topk_dp = forward(dp_layer, x, mask)  # B = 2 rows: one per data shard
assert (np.asarray(topk_dp) == np.asarray(topk)).all()
np.testing.assert_allclose(out_dp, out, rtol=1e-5, atol=1e-5)
print(f"data 2 x tp 2: out sharded as {out_dp.sharding.spec}; same top-k and outputs")
print("\nquickstart: ok")
