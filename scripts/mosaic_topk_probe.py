#!/usr/bin/env python
"""Probe the Mosaic GPU ``topk_pools`` kernel's building blocks one at a time on a GPU.

The kernel (``pallas_kernels.mosaic_selection``) is right in ``"mosaic_interpret"`` and was
wrong on an H200 (2026-12-04). Each probe here runs one building block as its own tiny
``plmgpu.kernel`` and compares it with numpy, so one run on hardware says which block
the interpreter models differently from the GPU::

    python scripts/mosaic_topk_probe.py                # on a GPU: implementation "mosaic"
    python scripts/mosaic_topk_probe.py --interpret    # on a CPU: the interpreter

Probes: a strided iota stored to GMEM; a row's order keys loaded from GMEM; the counts of
one pass; a ``min`` over masked lanes; a scalar store loop; the threshold of a full radix
select; the whole kernel on one small row. Each prints ``ok`` or the first differing
elements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import mosaic_selection as ms  # noqa: E402
from pallas_kernels._common import require_mosaic_gpu  # noqa: E402
from pallas_kernels._order_key import order_key  # noqa: E402
from pallas_kernels.selection import topk_pools_reference  # noqa: E402


ROWS: list[dict] = []


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _report(name, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape == want.shape and np.array_equal(got, want):
        _log(f"{name:<28} ok")
        ROWS.append(dict(kernel="topk_pools", impl="mosaic probe", name=name, check="ok"))
        return True
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1)) if got.shape == want.shape else np.arange(want.size)
    check = f"MISMATCH {len(bad)} of {want.size}; first at {bad[:8].tolist()}"
    _log(f"{name:<28} {check}")
    _log(f"    got  {got.reshape(-1)[:24].tolist()}")
    _log(f"    want {want.reshape(-1)[:24].tolist()}")
    if got.shape == want.shape and len(bad):
        _log(f"    got[bad]  {got.reshape(-1)[bad[:12]].tolist()}")
        _log(f"    want[bad] {want.reshape(-1)[bad[:12]].tolist()}")
    ROWS.append(dict(kernel="topk_pools", impl="mosaic probe", name=name, check=check,
                     got=got.reshape(-1)[:24].tolist(), want=want.reshape(-1)[:24].tolist()))
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="run the probes in interpret mode")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object on stdout")
    args = ap.parse_args(argv)
    plmgpu = require_mosaic_gpu("mosaic_topk_probe")
    interp = {"interpret": plmgpu.InterpretGPUParams()} if args.interpret else {}
    params = plmgpu.CompilerParams(lowering_semantics=plmgpu.LoweringSemantics.Lane)
    _log(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, interpret={args.interpret}")

    def kernel(body, out_shape, grid=(1,), names=("row",), scratch=(), name="probe"):
        return plmgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, jnp.int32),
                             scratch_types=list(scratch), grid=grid, grid_names=names,
                             kernel_name=name, compiler_params=params, **interp)

    rng = np.random.default_rng(0)
    n = 1024
    scores = rng.standard_normal((1, n)).astype(np.float32)
    scores[0, :8] = [0.0, -0.0, 1.0, 1.0, -np.inf, np.nan, 2.0, -1.0]
    keys_np = np.asarray(order_key(jnp.asarray(scores)))
    live = jnp.asarray([n], jnp.int32)
    results = []

    # 1. a strided iota of 256 (2 a thread) stored to GMEM.
    def iota_body(o_ref):
        o_ref[0, pl_ds(0, 256)] = ms._iota(plmgpu, 256)
    results.append(_report("iota 256 -> gmem", kernel(iota_body, (1, 256))(), np.arange(256)[None]))

    # 2. the order keys of chunk 1 (pools 256..511), loaded from GMEM.
    def keys_body(s_ref, o_ref):
        view = ms._Row(plmgpu, s_ref, 0, jnp.int32(0), jnp.int32(n))
        o_ref[0, pl_ds(0, 256)] = view.keys(1, 256, ms._iota(plmgpu, 256))
    results.append(_report("keys chunk 1", kernel(keys_body, (1, 256))(jnp.asarray(scores)),
                           keys_np[:, 256:512]))

    # 3. the counts of 16 candidates over the row.
    cands_np = np.sort(rng.choice(keys_np[0], 16, replace=False)).astype(np.int32)

    def counts_body(s_ref, c_ref, o_ref):
        view = ms._Row(plmgpu, s_ref, 0, jnp.int32(0), jnp.int32(n))
        cands = [c_ref[0, j] for j in range(16)]
        for j, c in enumerate(view.counts(cands, 1024)):
            o_ref[0, j] = c
    want = np.array([[np.sum(keys_np[0] >= c) for c in cands_np]])
    results.append(_report("counts of 16 candidates", kernel(counts_body, (1, 128))(
        jnp.asarray(scores), jnp.asarray(cands_np)[None])[:, :16], want))

    # 4. min over masked lanes, for 8 lower bounds; and a sum.
    def min_body(o_ref):
        lanes = ms._iota(plmgpu, 256)
        for i, lo in enumerate((0, 1, 2, 7, 128, 129, 200, 255)):
            o_ref[0, i] = jnp.min(jnp.where(lanes >= lo, lanes, 256))
        o_ref[0, 8] = jnp.sum(lanes)
    results.append(_report("min over lanes, sum", kernel(min_body, (1, 128))()[:, :9],
                           np.array([[0, 1, 2, 7, 128, 129, 200, 255, 255 * 128]])))

    # 5. scalar stores in a while loop over a -1 fill.
    def store_body(o_ref):
        o_ref[0, pl_ds(0, 128)] = jnp.full((128,), -1, jnp.int32)

        def step(c):
            i, v = c
            o_ref[0, i] = v
            return i + 1, v + 3
        jax.lax.while_loop(lambda c: c[0] < 40, step, (jnp.int32(0), jnp.int32(5)))
    want = np.full((1, 128), -1)
    want[0, :40] = 5 + 3 * np.arange(40)
    results.append(_report("scalar stores over -1", kernel(store_body, (1, 128))(), want))

    # 6. the threshold (radix passes) of a row, K = 100, radix bits 4 and 1.
    k = 100
    thresh_np = np.sort(keys_np[0])[::-1][k - 1]
    want = np.array([[thresh_np, np.sum(keys_np[0] > thresh_np)]])
    for bits in (4, 1):
        def thresh_body(s_ref, live_ref, o_ref, bits=bits):
            view = ms._Row(plmgpu, s_ref, 0, jnp.int32(0), live_ref[0])
            t, n_gt = ms._threshold(view, live_ref[0], n_pools=n, select_k=k, block_p=1024,
                                    radix_bits=bits)
            o_ref[0, 0] = t
            o_ref[0, 1] = n_gt
        results.append(_report(f"threshold radix_bits={bits}", kernel(thresh_body, (1, 128))(
            jnp.asarray(scores), live)[:, :2], want))

    # 7. the compaction alone, given the reference's threshold.
    def compact_body(s_ref, o_ref, tile_smem):
        view = ms._Row(plmgpu, s_ref, 0, jnp.int32(0), jnp.int32(n))
        o_ref[0, pl_ds(0, 128)] = jnp.full((128,), -1, jnp.int32)
        n_gt = int(want[0, 1])
        view.compact(o_ref, tile_smem, 1024, jnp.int32(int(thresh_np)), jnp.int32(0),
                     jnp.int32(0), jnp.int32(k - n_gt), jnp.int32(k))
    results.append(_report("compaction K=100", kernel(
        compact_body, (1, 128), scratch=[plmgpu.SMEM((1024,), jnp.int32)])(
            jnp.asarray(scores))[:, :k], np.asarray(topk_pools_reference(
                jnp.asarray(scores)[None], k))[0]))

    # 8. the whole kernel on small rows, both paths.
    for p, k, blocks in ((256, 16, {}), (1024, 100, {}), (4096, 512, {}),
                         (4096, 512, dict(split_p=512, block_p=512))):
        x = jnp.asarray(rng.standard_normal((2, 1, p)).astype(np.float32))
        impl = "mosaic_interpret" if args.interpret else "mosaic"
        got = pk.topk_pools(x, k, implementation=impl,
                            block_sizes=pk.MosaicTopkPoolsBlockSizes(**blocks))
        results.append(_report(f"topk_pools P={p} K={k} {blocks or ''}", got,
                               topk_pools_reference(x, k)))
    _log(f"{sum(results)} of {len(results)} probes ok")
    if args.json:
        print(json.dumps(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                              interpret=args.interpret, ok=all(results), rows=ROWS)))
    else:
        for r in ROWS:
            print(f"{r['name']:<40} {r['check']}")
    return 0 if all(results) else 1


def pl_ds(start, size):
    from jax.experimental import pallas as pl
    return pl.ds(start, size)


if __name__ == "__main__":
    sys.exit(main())
