#!/usr/bin/env python
"""Time and check the backward kernels and one layer's training step on a lent GPU.

``python scripts/gpu_check.py --train`` runs this (or ``python scripts/gpu_check_train.py``);
one JSON object on stdout with ``--json``, a table otherwise, progress on stderr::

    python scripts/gpu_check_train.py --json             # GLM-5.3-Flash, 4K and 16K tokens
    python scripts/gpu_check_train.py --smoke --json     # tiny preset, pallas_interpret (CPU)

Per token count ``S`` (batch 1, every token a query, as a training sequence), the
selection comes from the forward pipeline (``kpool_compress``, ``index_scores``,
``topk_pools``, ``expand_selection``), then rows for:

* ``sparse_mla``: ``fwd_us`` the jitted forward, ``fwd_bwd_us`` the jitted ``jax.vjp`` of it
  w.r.t. ``q`` and ``latent`` applied to a random ``d_out``, ``bwd_us`` their difference;
  the gradients checked against ``implementation="xla"``'s (``check``; the ``"xla"`` row
  runs in tiles of ``REFERENCE_TILE`` queries, as its gathered rows would not fit whole)
  and, for 16-bit operands, by the float32 rule (``glm5_dsa_jax.tools.float32_rule``: each
  operand's gradient within ``RATIO`` of bf16 ``"xla"``'s distance from float32 ``"xla"``,
  or ``KERNEL_FLOOR``; ``errs_f32`` per operand), which then decides;
* ``index_scores``: the same w.r.t. ``q``, ``w`` and ``pooled``, for a random ``d_scores``
  on the candidates (0 elsewhere, as an indexer loss gives);
* ``layer``: ``glm5_dsa_jax.tools.bench_train`` (``glm5-dsa bench train``'s rows: the
  layer's ``jax.value_and_grad``, ``sparse`` and ``dense_mask``, scratch memory per token,
  time where it fits the device) and, at the first ``S``, the layer's parameter gradients
  checked against ``"xla"``'s.

Only public entry points are called (``pk.sparse_mla``, ``pk.index_scores``, the layer's
call under ``jax.vjp`` / ``jax.value_and_grad``), so whatever ``custom_vjp`` they carry is
what is timed. ``bound_us``: the roofline's bound of the same work
(``glm5_dsa_jax.tools.roofline.train_rows``: for ``sparse_mla`` its forward row plus the
backward's ``lse_delta``, ``dq``, ``selection_transpose`` and ``dlatent`` rows; for
``index_scores`` the forward and both backward rows), at the device's GPU (``--roofline-gpu``).
Exit status 0 when no check failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from glm5_dsa_jax.model.config import DsaConfig  # noqa: E402
from glm5_dsa_jax.tools import bench_train, float32_rule, roofline  # noqa: E402

#: Roofline rows whose bounds add up to each kernel row's work (fwd + bwd).
BOUND_ROWS = {
    "sparse_mla": ("sparse_mla", "xla:lse_delta", "sparse_mla_bwd:dq", "selection_transpose",
                   "sparse_mla_bwd:dlatent"),
    "index_scores": ("index_scores", "index_scores_bwd:dq_dw", "index_scores_bwd:dpooled"),
}


#: Queries per tile of the ``"xla"`` ``sparse_mla`` reference rows: its backward gathers
#: ``[queries, W, CR]`` float32 rows (17 GB for 4K queries at GLM-5.3-Flash), so the
#: reference runs tile by tile (``lax.map``); the kernels run whole.
REFERENCE_TILE = 1024


def by_query_tiles(f, tile: int, q, lat, ids):
    """``f(q, lat, ids)`` over tiles of ``tile`` queries (``lax.map``; one call when the
    queries are fewer or do not divide): ``[B, Q, H, V]``."""
    b, n = q.shape[:2]
    if n <= tile or n % tile:
        return f(q, lat, ids)
    cut = lambda a: a.reshape(b, n // tile, tile, *a.shape[2:]).swapaxes(0, 1)  # noqa: E731
    out = jax.lax.map(lambda t: f(t[0], lat, t[1]), (cut(q), cut(ids)))
    return out.swapaxes(0, 1).reshape(b, n, *out.shape[3:])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_s(fn, args, reps: int) -> tuple[object, float, float]:
    """``(output, compile + first call seconds, median seconds of reps calls)``."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return out, first, statistics.median(times)


def rel_error(got, want) -> float:
    """The worst leaf's ``max |got - want|`` over its ``max |want|`` (``inf`` for a shape
    mismatch or a non-finite value)."""
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if g.shape != w.shape or not np.isfinite(g).all():
            return float("inf")
        worst = max(worst, float(np.abs(g - w).max(initial=0.0)) / max(float(np.abs(w).max(initial=0.0)), 1e-30))
    return worst


def compare(got, want, tol: float) -> tuple[bool, str]:
    """Every leaf within ``tol`` of ``want`` relative to the leaf's largest magnitude."""
    worst = rel_error(got, want)
    if not np.isfinite(worst):
        return False, "MISMATCH shape or non-finite values"
    return worst <= tol, f"{'ok' if worst <= tol else 'MISMATCH'} (max err {worst:.1e} of the largest)"


def selection(cfg: DsaConfig, s: int, dtype, impl: str) -> dict:
    """Inputs of one sequence of ``s`` tokens (batch 1) and its selection by the forward
    pipeline under ``impl``."""
    kp, d, hi = cfg.index_kpool, cfg.index_head_dim, cfg.index_n_heads
    ks = jax.random.split(jax.random.key(0), 8)
    valid = jnp.ones((1, s), bool)
    keys = jax.random.normal(ks[0], (1, s, d), dtype)
    gate = jax.random.normal(ks[1], (1, s, d), jnp.float32)
    ape = 0.5 * jax.random.normal(ks[2], (kp, d), jnp.float32)
    pooled, first_key, pool_valid = pk.kpool_compress(keys, gate, valid, ape, implementation=impl)
    q_pos = jnp.arange(s, dtype=jnp.int32)[None]
    qi = jax.random.normal(ks[3], (1, s, hi, d), dtype)
    w = jax.random.normal(ks[4], (1, s, hi), jnp.float32) * hi**-0.5
    scores = pk.index_scores(qi, w, pooled, pool_valid, first_key, q_pos, kpool=kp, implementation=impl)
    pools = pk.topk_pools(scores, cfg.select_k(pooled.shape[1]), implementation=impl)
    tail = pk.visible_tail(first_key, q_pos + 1, q_pos, valid, kp) if cfg.tail_width else None
    ids = pk.expand_selection(pools, first_key, tail, kpool=kp, out_width=cfg.out_width, implementation=impl)
    nh, cr = cfg.num_attention_heads, cfg.kv_cache_dim
    return jax.block_until_ready(dict(
        qi=qi, w=w, pooled=pooled, pool_valid=pool_valid, first_key=first_key, q_pos=q_pos, ids=ids,
        d_scores=jnp.where(jnp.isfinite(scores), jax.random.normal(ks[5], scores.shape, jnp.float32), 0.0),
        q=jax.random.normal(ks[6], (1, s, nh, cr), dtype),
        latent=jax.random.normal(ks[7], (1, s, cr), dtype),
        d_out=jax.random.normal(ks[5], (1, s, nh, cfg.kv_lora_rank), dtype)))


class Runner:
    def __init__(self, args, cfg: DsaConfig):
        self.args, self.cfg = args, cfg
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.failed = False
        self.tol = 2e-2 if jnp.dtype(args.dtype) == jnp.bfloat16 else 1e-4

    def out_of_time(self) -> bool:
        return time.monotonic() - self.t0 > self.args.budget

    def bound_us(self, s: int, kernel: str):
        rows = roofline.train_rows(self.cfg, self.args.roofline_gpu, s, indexer_loss=True,
                                   elem_bytes=jnp.dtype(self.args.dtype).itemsize)
        return 1e6 * sum(r.bound_s for r in rows if r.kernel in BOUND_ROWS[kernel]
                         and r.phase in ("train_fwd", "train_bwd"))

    def add(self, **row) -> None:
        self.rows.append(row)
        t = lambda k: "-" if row.get(k) is None else f"{row[k]:.1f}"  # noqa: E731
        log(f"  S={row['tokens']:<6} {row['kernel']:<13} {row['impl']:<17} fwd {t('fwd_us')} us  "
            f"fwd+bwd {t('fwd_bwd_us')} us  bwd {t('bwd_us')} us  {row['check']}")

    def kernel(self, s: int, name: str, fwd, wrt: dict, cotangent) -> None:
        """Rows of ``fwd(impl)`` (a function of the ``wrt`` arrays, named by their keys)
        forward and under ``jax.vjp`` with ``cotangent``, for ``"xla"`` and each
        implementation under test:
        checked against ``"xla"`` (``tol``) and, for 16-bit inputs, against ``"xla"`` in
        float32 by the float32 rule (``glm5_dsa_jax.tools.float32_rule``, per operand's
        gradient, ``KERNEL_FLOOR``), which then decides."""
        row = dict(tokens=s, batch=1, kernel=name, bound_us=self.bound_us(s, name))
        names, wrt = tuple(wrt), tuple(wrt.values())
        want = ref32 = errs_xla = None
        if jnp.dtype(self.args.dtype).itemsize == 2 and not self.out_of_time():
            f32 = lambda a: jax.tree.map(lambda x: x.astype(jnp.float32), a)  # noqa: E731
            try:
                ref32 = jax.block_until_ready(jax.jit(
                    lambda *a: jax.vjp(fwd("xla"), *a)[1](cotangent.astype(jnp.float32)))(*f32(wrt)))
            except Exception as e:  # noqa: BLE001
                log(f"  {name}: float32 reference failed: {str(e).splitlines()[0][:200]}")
        for impl in dict.fromkeys(("xla", *self.args.impl)):  # xla once when it is one checked
            if self.out_of_time():
                self.add(**row, impl=impl, check="skipped (time budget)")
                continue
            f = fwd(impl)
            grad = jax.jit(lambda *a, f=f: jax.vjp(f, *a)[1](cotangent))
            try:
                _, c0, t_fwd = median_s(jax.jit(f), wrt, self.args.reps)
                got, c1, t_all = median_s(grad, wrt, self.args.reps)
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                self.failed = True
                if self.args.verbose:
                    traceback.print_exc(file=sys.stderr)
                self.add(**row, impl=impl, check=f"error: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
                continue
            check, errs32 = "reference", None
            if ref32 is not None:
                errs32 = float32_rule.tensor_errors(dict(zip(names, got)), dict(zip(names, ref32)))
            if impl == "xla":
                want, errs_xla = got, errs32
                if errs32 is not None:  # the baseline: finite, zero where float32's is
                    ok, rule, _ = float32_rule.judge(errs32, None)
                    check = f"reference, vs float32: {rule}"
                    self.failed |= not ok
            elif want is not None:
                ok, check = compare(got, want, self.tol)
                if errs32 is not None and errs_xla is not None:
                    # the float32 rule decides; the bf16 comparison is reported beside it
                    ok, rule, _ = float32_rule.judge(errs32, errs_xla, float32_rule.KERNEL_FLOOR)
                    check = f"{rule} vs float32; vs bf16 xla: {check}"
                self.failed |= not ok
            self.add(**row, impl=impl, fwd_us=t_fwd * 1e6, fwd_bwd_us=t_all * 1e6,
                     bwd_us=(t_all - t_fwd) * 1e6, compile_s=round(c0 + c1, 2), check=check,
                     errs_f32=errs32 and {k: float(f"{e:.3g}") for k, e in errs32.items()})

    def run_tokens(self, s: int) -> None:
        cfg, dt = self.cfg, jnp.dtype(self.args.dtype)
        log(f"S={s}: selection ({self.args.selection_impl})")
        inp = selection(cfg, s, dt, self.args.selection_impl)
        def mla(impl):
            f = lambda q, lat, ids: pk.sparse_mla(q, lat, ids, scale=cfg.softmax_scale,  # noqa: E731
                                                  value_width=cfg.kv_lora_rank, implementation=impl)
            if impl != "xla":
                return lambda q, lat: f(q, lat, inp["ids"])
            return lambda q, lat: by_query_tiles(f, REFERENCE_TILE, q, lat, inp["ids"])

        self.kernel(s, "sparse_mla", mla, dict(q=inp["q"], latent=inp["latent"]), inp["d_out"])
        self.kernel(s, "index_scores", lambda impl: (lambda qi, w, pooled: pk.index_scores(
            qi, w, pooled, inp["pool_valid"], inp["first_key"], inp["q_pos"], kpool=cfg.index_kpool,
            implementation=impl)), dict(q=inp["qi"], w=inp["w"], pooled=inp["pooled"]), inp["d_scores"])

    def layer(self) -> None:
        a = self.args
        if self.out_of_time():
            return
        impl = a.impl[0]
        res = bench_train.run(a.preset, a.tokens, [1], a.reps, impl, log=log, dtype=a.dtype)
        for r in res["rows"]:
            self.rows.append(dict(r, kernel="layer", check=r["note"]))
        s = a.tokens[0]  # the layer's gradients against "xla"'s, at the first token count
        x = jax.random.normal(jax.random.key(1), (1, s, self.cfg.hidden_size), jnp.float32).astype(a.dtype)
        g = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
        grads = {}
        for impl in dict.fromkeys(("xla", a.impl[0])):
            step, params = bench_train.sparse_step(bench_train.train_layer(a.preset, impl, jnp.dtype(a.dtype)))
            try:
                grads[impl] = jax.block_until_ready(step(params, x, g))
            except Exception as e:  # noqa: BLE001
                self.failed = True
                self.rows.append(dict(tokens=s, batch=1, kernel="layer grads", impl=impl,
                                      check=f"error: {str(e).splitlines()[0][:200]}"))
                return
        ok, check = compare(grads[impl], grads["xla"], self.tol)
        # Both sides are bf16 in other orders: this row is informational; the layer's
        # gradients are judged against float32 in scripts/gpu_check_layer.py.
        self.rows.append(dict(tokens=s, batch=1, kernel="layer grads", impl=impl,
                              check=check.replace("MISMATCH", "differs") + " (bf16 vs bf16; see the layer part)"))
        log(f"  layer grads {impl} vs xla at S={s}: {check}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny preset, 64 tokens, float32, implementation pallas_interpret (any device)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--tokens", default=None, help="comma-separated sequence lengths (default 4096,16384; "
                                                   "64 with --smoke)")
    ap.add_argument("--impl", default=None,
                    help="comma-separated implementations checked against xla (default pallas; "
                         "pallas_interpret with --smoke); the layer rows run the first")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per row (median; default 5, 1 with --smoke)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the kernel rows (default 300; none with --smoke, which "
                         "checks every row however loaded the machine is)")
    ap.add_argument("--no-layer", action="store_true", help="leave out the layer rows")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="operand dtype (default bfloat16; float32 with --smoke); 16-bit rows are "
                         "also judged against float32 xla (the float32 rule)")
    ap.add_argument("--roofline-gpu", choices=sorted(roofline.GPUS), default=None,
                    help="GPU of the bound column (default: from the device kind, else h100)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    args.preset = "tiny" if args.smoke else "glm53-flash"
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    args.tokens = [int(t) for t in (args.tokens or ("64" if args.smoke else "4096,16384")).split(",")]
    args.impl = (args.impl or ("pallas_interpret" if args.smoke else "pallas")).split(",")
    bad = [i for i in args.impl if i not in pk.IMPLEMENTATIONS or i == "auto"]
    if bad:
        ap.error(f"--impl: {bad} not among {[i for i in pk.IMPLEMENTATIONS if i != 'auto']}")
    args.reps = args.reps or (1 if args.smoke else 5)
    if args.budget is None:
        args.budget = float("inf") if args.smoke else 300.0
    args.selection_impl = "xla" if args.smoke or args.impl == ["xla"] else "pallas"
    cfg = DsaConfig.preset(args.preset)
    try:
        bench_train.check_tokens(cfg, args.tokens)
    except ValueError as e:
        ap.error(f"--tokens: {e}")
    dev = jax.devices()[0]
    if args.roofline_gpu is None:
        args.roofline_gpu = roofline.gpu_for_device_kind(getattr(dev, "device_kind", "")) or "h100"
    meta = dict(jax=jax.__version__, backend=jax.default_backend(), device=getattr(dev, "device_kind", str(dev)),
                smoke=args.smoke, preset=args.preset, dtype=args.dtype, impl=args.impl, tokens=args.tokens,
                reps=args.reps, roofline_gpu=args.roofline_gpu)
    log(f"jax {meta['jax']} on {meta['backend']} ({meta['device']}): {args.impl} against xla")
    runner = Runner(args, cfg)
    for s in args.tokens:
        try:
            runner.run_tokens(s)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory building the inputs
            runner.failed = True
            runner.rows.append(dict(tokens=s, batch=1, kernel="-", impl="-", check=f"error: {e}"[:200]))
    if not args.no_layer:
        runner.layer()
    meta.update(elapsed_s=round(time.monotonic() - runner.t0, 1), ok=not runner.failed)
    if args.json:
        print(json.dumps(dict(meta, rows=runner.rows), default=float))
    else:
        for r in runner.rows:
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
    return 0 if not runner.failed else 1


if __name__ == "__main__":
    sys.exit(main())
