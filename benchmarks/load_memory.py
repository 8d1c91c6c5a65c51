"""Peak host memory of loading one GLM-5.3-Flash-shaped DSA layer onto an 8-device mesh.

    python benchmarks/load_memory.py [--devices 8] [--dtype bfloat16] [--naive] [--dir DIR]

Writes a checkpoint directory (flat ``config.json`` of ``DsaConfig.glm53_flash()``, one DSA
layer's tensors, random, in bf16: ``model.layers.3.self_attn.*``) in a subprocess, then
loads it in fresh subprocesses with ``--devices`` virtual CPU devices and reports:

* ``weights``: the layer's tensors on disk;
* ``on devices``: the bytes of every device buffer after the load (sharded parameters once
  in total, replicated ones once per device). On CPU "devices" are host memory, so this
  part of the peak is the result itself, not loader overhead;
* ``peak RSS - baseline``: the process's resident-memory high-water mark during the load
  (RSS sampled every 1 ms, and ``ru_maxrss``) above its RSS just before it;
* ``overhead``: that minus ``on devices`` -- what the loader itself held at its worst.

``--naive`` also measures the obvious alternative for contrast: read every tensor whole
(``safetensors.numpy.load_file``), convert with ``hf_to_params`` on one device, then
``device_put`` onto the mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

LAYER = 3  # the first DSA layer of GLM-5.3-Flash (every 4th layer, from index 3)


def write_checkpoint(path: str) -> None:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    import glm5_dsa_jax as gd

    cfg = gd.DsaConfig.glm53_flash()
    assert LAYER in cfg.dsa_layers and cfg.has_indexer(LAYER)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in gd.hf_weight_shapes(cfg, LAYER).items():
        scale = shape[-1] ** -0.5 if len(shape) == 2 else 0.1
        tensors[f"model.layers.{LAYER}.self_attn.{name}"] = (
            rng.standard_normal(shape, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict() | {"model_type": "glm5_next"}, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def measure(path: str, n_dev: int, dtype: str, naive: bool) -> dict:
    import resource

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm5_dsa_jax import checkpoint

    devices = jax.devices()
    assert len(devices) >= n_dev, f"need {n_dev} devices, have {len(devices)}"
    mesh = jax.make_mesh((n_dev,), ("tp",), devices=devices[:n_dev])
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    rss0 = _rss()
    maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    if naive:
        params = _naive(path, mesh, jnp.dtype(dtype))
    else:
        layers = checkpoint.load_hf_checkpoint(path, mesh=mesh, layers=[LAYER], dtype=jnp.dtype(dtype),
                                               progress=False)
        params = nnx.to_pure_dict(nnx.state(layers[LAYER], nnx.Param))
    leaves = jax.block_until_ready(jax.tree.leaves(params))
    secs = time.perf_counter() - t0
    stop.set()
    th.join()
    maxrss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak_rss = max(peak[0], maxrss1 if maxrss1 > maxrss0 else 0)
    rss1 = _rss()
    on_devices = sum(s.data.nbytes for a in leaves for s in a.addressable_shards)
    return {
        "mode": "naive" if naive else "sliced",
        "devices": n_dev,
        "seconds": secs,
        "rss_before": rss0,
        "peak_rss": peak_rss,
        "peak_minus_baseline": peak_rss - rss0,
        "after_minus_baseline": rss1 - rss0,
        "on_devices": on_devices,
        "logical_param_bytes": sum(a.nbytes for a in leaves),
    }


def _rss() -> int:
    """Current resident set size in bytes (psutil if installed, else /proc/self/statm)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _naive(path, mesh, dtype):
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from safetensors.numpy import load_file

    import glm5_dsa_jax as gd
    from glm5_dsa_jax.model.weights import hf_to_params

    cfg = gd.DsaConfig.from_hf_config(path)
    raw = load_file(os.path.join(path, "model.safetensors"))
    pfx = f"model.layers.{LAYER}.self_attn."
    params = hf_to_params(cfg, LAYER, {k[len(pfx):]: v for k, v in raw.items()}, dtype)
    del raw
    abstract = nnx.eval_shape(lambda: gd.DsaAttention(cfg, LAYER, rngs=nnx.Rngs(0), param_dtype=dtype))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract, nnx.Param)))
    out = {}
    for p, v in params.items():
        spec = specs
        for k in p:
            spec = spec[k]
        out[p] = jax.device_put(v, NamedSharding(mesh, spec))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--naive", action="store_true", help="also measure whole-tensor reads + device_put")
    ap.add_argument("--dir", help="checkpoint directory to (re)use; default: a temporary one")
    ap.add_argument("--_write", help=argparse.SUPPRESS)
    ap.add_argument("--_measure", help=argparse.SUPPRESS)
    ap.add_argument("--_naive", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._write:
        write_checkpoint(args._write)
        return 0
    if args._measure:
        print(json.dumps(measure(args._measure, args.devices, args.dtype, args._naive)))
        return 0

    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="glm5_load_memory_")
        path = tmp.name
    me = os.path.abspath(__file__)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        subprocess.run([sys.executable, me, "--_write", path], check=True)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
    weights = os.path.getsize(os.path.join(path, "model.safetensors"))
    print(f"GLM-5.3-Flash DSA layer {LAYER} (DsaConfig.glm53_flash(), full indexer), bf16 weights: "
          f"{weights / 2**20:.1f} MiB on disk; loading onto {args.devices} CPU devices as {args.dtype}")
    modes = [False, True] if args.naive else [False]
    for naive in modes:
        cmd = [sys.executable, me, "--_measure", path, "--devices", str(args.devices), "--dtype", args.dtype]
        out = subprocess.run(cmd + (["--_naive"] if naive else []), check=True, env=env,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        mib = lambda b: f"{b / 2**20:8.1f} MiB"
        over = r["peak_minus_baseline"] - r["on_devices"]
        print(f"\n[{r['mode']}] {r['seconds']:.2f} s")
        print(f"  parameters (logical)     {mib(r['logical_param_bytes'])}")
        print(f"  on devices (all shards)  {mib(r['on_devices'])}")
        print(f"  RSS after - baseline     {mib(r['after_minus_baseline'])}")
        print(f"  peak RSS - baseline      {mib(r['peak_minus_baseline'])}   "
              f"({r['peak_minus_baseline'] / weights:.2f}x the weights)")
        print(f"  overhead beyond devices  {mib(over)}   ({over / weights:.2f}x the weights)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
