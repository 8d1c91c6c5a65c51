"""One process of the 2-process ``jax.distributed`` test (tests/test_multihost.py).

``python _multihost_worker.py PORT PROCESS_ID NUM_PROCESSES OUT_DIR``: joins the job on
127.0.0.1:PORT, builds the global 8-device CPU mesh, places the test layer with
``shard_layer``, runs the jitted prefill and a decode step, and writes what this process
holds (every addressable shard of the replicated outputs) to ``OUT_DIR/proc{ID}.npz``.
The environment (set by the test) gives each process 4 CPU devices.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import glm5_dsa_jax as gd  # noqa: E402
from glm5_dsa_jax import parallel, sharding as sh  # noqa: E402


def build_inputs(cfg):
    """The test's layer and inputs: the same values in every process."""
    layer = gd.DsaAttention(
        cfg, 1, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32, block_q=8,
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 14, cfg.hidden_size)).astype(np.float32)
    mask = np.ones((3, 14), bool)
    mask[1, :3] = False
    mask[2, :7] = False
    return layer, x, mask


def run(layer, mesh, x, mask):
    """Sharded prefill (13 tokens, with a cache) then one decode step, jitted."""
    sh.shard_layer(layer, mesh)
    graphdef, state = nnx.split(layer)

    @jax.jit
    def step(state, x, mask, cache):
        return nnx.merge(graphdef, state)(x, attention_mask=mask, cache=cache)

    cache = layer.init_cache(x.shape[0], 16)  # replicated over both processes
    # Inputs become global (replicated) arrays: every process passes the same values.
    x1, m1, x2, m2 = parallel.place_inputs(mesh, x[:, :13], mask[:, :13], x[:, 13:], mask[:, 13:])
    out, topk, cache = step(state, x1, m1, cache)
    out2, topk2, cache = step(state, x2, m2, cache)
    return out, topk, out2, topk2


def main():
    port, pid, nproc, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
        initialization_timeout=60,
    )
    assert jax.process_count() == nproc, jax.process_count()
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
