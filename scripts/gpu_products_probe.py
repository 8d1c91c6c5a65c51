#!/usr/bin/env python
"""Which form of a decode step's projection XLA runs at HBM speed on this GPU.

A decode step multiplies 1 to 64 query rows by each weight (issue 46). On the first H200
run XLA turned one-row products into a multiply and a column reduce, far from the
weight's read time. This times, for the GLM-5.3-Flash projection shapes, each form of
``x [M, K] @ W`` in one jitted program, unrolled (``glm5_dsa_jax.tools.timing.loop_time``: device time, no
dispatch), and prints its read rate (the weight's bytes over the time) and what the
compiled program ran (a cuBLAS GEMM custom call, a Triton GEMM fusion, a reduce)::

    python scripts/gpu_products_probe.py [--json]

Forms: ``kn`` (weight stored ``[K, N]``, ``x @ w``), ``nk`` (stored ``[N, K]``,
``x @ w.T``), each with a float32 or a bf16 result, ``kn pad16`` (the rows padded to 16,
then sliced: the GEMM path's smallest tile) and ``kn x2`` (one row as two copies of it,
the first result kept: a Triton GEMM on the stored layout from one row, with no
contraction-last copy of the weight). The step's GPU policy multiplies ``nk`` copies
(``cpu_policy``, "Products on a GPU"); ``kn x2`` is the form that would spare those copies'
memory: which runs nearer the weight's read time decides between them. ``--forms`` and
``--shapes`` narrow the run (``gpu_check.py --all`` runs the three that decide at 1 and 8
rows); ``--budget`` stops it early.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from glm5_dsa_jax.tools.timing import loop_time  # noqa: E402

#: (name, K, N): GLM-5.3-Flash's decode projections (hidden 4096, q_lora_rank 1536, 64
#: heads, kv_lora_rank 512, indexer 32 x 128; DsaConfig.preset("glm53-flash")).
SHAPES = [("q_a", 4096, 1536), ("q_b absorbed", 1536, 64 * 512), ("kv_a", 4096, 512),
          ("index wq_b", 1536, 32 * 128), ("index wk", 4096, 128), ("o_proj", 64 * 256, 4096)]


def _what_ran(fn, *args) -> str:
    text = jax.jit(fn).lower(*args).compile().as_text()
    kinds = []
    if re.search(r'custom_call_target="__cublas\$gemm"|cublas', text):
        kinds.append("cublas")
    if "__triton_gemm" in text or 'kind":"__triton_gemm' in text:
        kinds.append("triton gemm")
    if re.search(r"\breduce\(", text):
        kinds.append("reduce")
    return "+".join(kinds) or "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--forms", default=None, help="comma-separated forms (default: every form)")
    ap.add_argument("--shapes", default=None, help="comma-separated SHAPES names (default: all)")
    ap.add_argument("--calls", type=int, default=10, help="calls of the shorter in-loop program")
    ap.add_argument("--budget", type=float, default=None, help="seconds; later rows are skipped")
    args = ap.parse_args(argv)
    import time

    t_end = time.monotonic() + (args.budget or float("inf"))
    pick = lambda text: None if text is None else {t.strip() for t in text.split(",")}  # noqa: E731
    want_forms, want_shapes = pick(args.forms), pick(args.shapes)
    rows = []
    # An iteration of the timing loop costs this much by itself (a trivial body).
    overhead = loop_time(lambda v: v * 2.0, (jnp.ones((1024,), jnp.float32),), 10, 3)
    print(f"loop overhead {overhead * 1e6:.1f} us an iteration", file=sys.stderr, flush=True)
    for name, k, n in [s for s in SHAPES if want_shapes is None or s[0] in want_shapes]:
        w_kn = jax.random.normal(jax.random.key(0), (k, n), jnp.float32).astype(jnp.bfloat16)
        w_nk = jnp.asarray(w_kn.T)
        for m in map(int, args.rows.split(",")):
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
            forms = {
                "kn f32": (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), w_kn),
                "kn bf16": (lambda x, w: jnp.dot(x, w), w_kn),
                "nk f32": (lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                            preferred_element_type=jnp.float32), w_nk),
                "nk bf16": (lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))), w_nk),
                "kn pad16 f32": (lambda x, w: jnp.dot(jnp.pad(x, ((0, max(16 - x.shape[0], 0)), (0, 0))), w,
                                                      preferred_element_type=jnp.float32)[:x.shape[0]], w_kn),
                "kn x2 f32": (lambda x, w: jnp.dot(jnp.concatenate([x, x]) if x.shape[0] == 1 else x, w,
                                                   preferred_element_type=jnp.float32)[:x.shape[0]], w_kn),
            }
            for form, (fn, w) in forms.items():
                if want_forms is not None and form not in want_forms:
                    continue
                if time.monotonic() > t_end:
                    rows.append(dict(name=name, m=m, k=k, n=n, form=form, skipped="budget"))
                    continue
                try:
                    t = loop_time(fn, (x, w), args.calls, 3)
                    ran = _what_ran(fn, x, w)
                    row = dict(name=name, m=m, k=k, n=n, form=form, us=t * 1e6,
                               gbps=k * n * 2 / t / 1e9 if t else None, ran=ran)
                except Exception as e:  # noqa: BLE001
                    row = dict(name=name, m=m, k=k, n=n, form=form, error=str(e)[:200])
                rows.append(row)
                print(f"{name:<12} M={m:<3} {form:<13} {row.get('us', 0):8.1f} us "
                      f"{row.get('gbps') or 0:7.0f} GB/s  {row.get('ran', row.get('error'))}",
                      file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                              loop_overhead_us=overhead * 1e6, rows=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
