"""One process of the 2-process ``jax.distributed`` tests (tests/test_multihost.py).

``python _multihost_worker.py PORT PROCESS_ID NUM_PROCESSES OUT_DIR [tp|dp|cp]``: joins the
job on 127.0.0.1:PORT and writes what this process holds to ``OUT_DIR/proc{ID}.npz``.

* ``tp`` (default; each process has 4 CPU devices): the global 8-device mesh ``("tp",)``,
  the test layer placed with ``shard_layer``, the jitted prefill and a decode step; every
  addressable shard of the replicated outputs is written.
* ``dp`` (each process has 2 CPU devices): the mesh ``("data", "tp") = (2, 2)`` with the
  data axis across the processes and tp within each, the layer placed with
  ``batch_axis="data"``; a jitted prefill chunk and a decode step on a contiguous and on a
  paged cache. Each process holds only its own sequences' rows: every addressable shard is
  written with the first row it holds.
* ``cp`` (each process has 2 CPU devices): the mesh ``("cp", "tp") = (2, 2)`` with the
  sequence axis across the processes (each holds half of every sequence's slots and
  pools), the layer placed with ``seq_axis="cp"``; a jitted chunked prefill (two chunks),
  the cache saved with ``save_cache`` and restored with ``restore_cache`` onto the same
  mesh, then a decode step from it. The replicated outputs and the slot range each device
  holds are written.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import glm5_dsa_jax as gd  # noqa: E402
from glm5_dsa_jax.parallel import placement, sharding as sh  # noqa: E402


def padded_inputs(cfg, seed, left_pads, seq=14):
    """``x [B, seq, hidden]`` float32 from ``seed`` and its mask, row ``i`` left-padded by
    ``left_pads[i]`` tokens: the same values in every process."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(left_pads), seq, cfg.hidden_size)).astype(np.float32)
    mask = np.ones((len(left_pads), seq), bool)
    for row, pad in enumerate(left_pads):
        mask[row, :pad] = False
    return x, mask


def build_inputs(cfg):
    """The test's layer and inputs: the same values in every process."""
    layer = gd.DsaAttention(
        cfg, 1, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32, block_q=8,
    )
    return (layer, *padded_inputs(cfg, 0, (0, 3, 7)))


def run(layer, mesh, x, mask):
    """Sharded prefill (13 tokens, with a cache) then one decode step, jitted."""
    sh.shard_layer(layer, mesh)
    graphdef, state = nnx.split(layer)

    @jax.jit
    def step(state, x, mask, cache):
        return nnx.merge(graphdef, state)(x, attention_mask=mask, cache=cache)

    cache = layer.init_cache(x.shape[0], 16)  # replicated over both processes
    # Inputs become global (replicated) arrays: every process passes the same values.
    x1, m1, x2, m2 = placement.replicate((x[:, :13], mask[:, :13], x[:, 13:], mask[:, 13:]), mesh)
    out, topk, cache = step(state, x1, m1, cache)
    out2, topk2, cache = step(state, x2, m2, cache)
    return out, topk, out2, topk2


def build_dp_inputs(cfg):
    """The data-parallel case's layer and inputs: 4 sequences (2 per data shard)."""
    layer, _, _ = build_inputs(cfg)
    return (layer, *padded_inputs(cfg, 1, (0, 3, 0, 6)))


def dp_mesh():
    """``("data", "tp") = (2, 2)``: row k of the device grid is process k's devices."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("data", "tp"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def run_dp(layer, mesh, x, mask):
    """Jitted prefill (13 tokens) then one decode step on a contiguous and a paged cache;
    ``mesh=None``: the unsharded layer (the reference)."""
    if mesh is not None:
        sh.shard_layer(layer, mesh, "tp", batch_axis="data")
    graphdef, state = nnx.split(layer)

    @jax.jit
    def step(state, x, mask, cache):
        return nnx.merge(graphdef, state)(x, attention_mask=mask, cache=cache)

    results = []
    for cache in (layer.init_cache(4, 16), layer.init_paged_cache(4, 8, 8, pages_per_seq=2)):
        for sl in (slice(0, 13), slice(13, 14)):
            xs, ms = x[:, sl], mask[:, sl]
            if mesh is not None:  # global arrays split by sequence: every process passes all rows
                rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
                xs, ms = placement.put(xs, rows), placement.put(ms, rows)
            out, topk, cache = step(state, xs, ms, cache)
            results += [out, topk]
    return results


DP_NAMES = ("out", "topk", "out2", "topk2", "pout", "ptopk", "pout2", "ptopk2")

#: Context parallelism: a 32-slot cache (cp 2 x kpool 4 divides it), prefilled in two
#: chunks (29 tokens: 7 pools, more than select_k 4), then one decode step; the results
#: named as ``CP_NAMES``.
CP_LEN, CP_SPANS = 32, (slice(0, 16), slice(16, 29), slice(29, 30))
CP_NAMES = ("out", "topk", "out2", "topk2", "out3", "topk3")


def cp_mesh():
    """``("cp", "tp") = (2, 2)``: row k of the device grid is process k's devices, so each
    process holds one half of every sequence's slots and pools."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("cp", "tp"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def run_cp(layer, mesh, x, mask, save_to=None):
    """Jitted chunked prefill (8 then 5 tokens) and a decode step on a contiguous cache;
    ``mesh=None``: the unsharded layer (the reference). ``save_to``: the cache is saved
    there after the prefill (``save_cache``, every process writing its shards) and the
    decode step runs from ``restore_cache`` of it. ``(results, cache)``."""
    if mesh is not None:
        sh.shard_layer(layer, mesh, "tp", seq_axis="cp")
    graphdef, state = nnx.split(layer)

    @jax.jit
    def step(state, x, mask, cache):
        return nnx.merge(graphdef, state)(x, attention_mask=mask, cache=cache)

    cache = layer.init_cache(x.shape[0], CP_LEN)
    results = []
    for sl in CP_SPANS:
        if save_to is not None and sl is CP_SPANS[-1]:
            gd.save_cache(cache, save_to)
            cache = gd.restore_cache(save_to, mesh, seq_axis="cp")
        xs, ms = x[:, sl], mask[:, sl]
        if mesh is not None:
            xs, ms = placement.replicate((xs, ms), mesh)
        out, topk, cache = step(state, xs, ms, cache)
        results += [out, topk]
    return results, cache


def build_cp_inputs(cfg):
    """The context-parallel case's layer and inputs: 3 sequences of 30 slots."""
    layer, _, _ = build_inputs(cfg)
    return (layer, *padded_inputs(cfg, 2, (0, 3, 7), seq=30))


def main_cp(pid, out_dir):
    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    layer, x, mask = build_cp_inputs(gd.DsaConfig.tiny(num_attention_heads=8))
    results, cache = run_cp(layer, cp_mesh(), x, mask, save_to=f"{out_dir}/cache")
    saved = {}
    for name, a in zip(CP_NAMES, results):
        assert a.sharding.is_fully_replicated and not a.is_fully_addressable
        for k, s in enumerate(a.addressable_shards):
            saved[f"{name}_{k}"] = np.asarray(s.data)
    for k, s in enumerate(cache.latent_store.addressable_shards):  # this process's slots
        saved[f"slots_{k}"] = np.array([s.index[1].start or 0, s.index[1].stop or CP_LEN], np.int64)
    np.savez(f"{out_dir}/proc{pid}.npz", **saved)
    jax.distributed.shutdown()


def main_dp(pid, out_dir):
    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    layer, x, mask = build_dp_inputs(gd.DsaConfig.tiny(num_attention_heads=8))
    mesh = dp_mesh()
    saved = {}
    for name, a in zip(DP_NAMES, run_dp(layer, mesh, x, mask)):
        assert not a.is_fully_addressable and a.sharding.spec[0] == "data"
        for k, s in enumerate(a.addressable_shards):
            saved[f"{name}_{k}"] = np.asarray(s.data)
            saved[f"{name}_{k}_row"] = np.int64(s.index[0].start or 0)
    np.savez(f"{out_dir}/proc{pid}.npz", **saved)
    jax.distributed.shutdown()


def main():
    port, pid, nproc, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mode = sys.argv[5] if len(sys.argv) > 5 else "tp"
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
        initialization_timeout=60,
    )
    assert jax.process_count() == nproc, jax.process_count()
    if mode == "dp":
        return main_dp(pid, out_dir)
    if mode == "cp":
        return main_cp(pid, out_dir)
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 8 // nproc
    cfg = gd.DsaConfig.tiny(num_attention_heads=8)
    layer, x, mask = build_inputs(cfg)
    mesh = jax.make_mesh((8,), ("tp",))  # one mesh over both processes' devices
    results = run(layer, mesh, x, mask)
    saved = {}
    for name, a in zip(("out", "topk", "out2", "topk2"), results):
        assert a.sharding.is_fully_replicated and not a.is_fully_addressable
        shards = [np.asarray(s.data) for s in a.addressable_shards]
        assert len(shards) == 8 // nproc
        for k, s in enumerate(shards):
            saved[f"{name}_{k}"] = s
    # The head-sharded parameters really are split across the processes.
    w = layer.q_b_proj[...]
    saved["q_b_proj_heads"] = np.array(
        [s.index[1].start for s in w.addressable_shards], dtype=np.int64
    )
    np.savez(f"{out_dir}/proc{pid}.npz", **saved)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
