#!/usr/bin/env python
"""One whole DSA layer under each kernel implementation, against ``"xla"`` on the same device:
prefill and decode over the contiguous and the paged cache, and the parameter gradients of
two losses judged against a float32 reference.

    python scripts/gpu_check_layer.py                  # GLM-5.3-Flash's first DSA layer: a table
    python scripts/gpu_check_layer.py --json           # the same rows as one JSON object on stdout
    python scripts/gpu_check_layer.py --smoke          # tiny preset, interpret mode (any CPU)
    python scripts/gpu_check_layer.py --impls pallas --tokens 2048 --budget 300

Progress goes to stderr. ``main(argv)`` returns the exit status and ``run(...)`` the rows, so
``scripts/gpu_check.py`` can run this as one of its parts.

**The layer.** ``DsaConfig.preset("glm53-flash")``'s first DSA layer (``cfg.dsa_layers[0]``,
layer 3), random weights from ``nnx.Rngs(0)``, bf16 parameters and compute, query tiles of 64.
Every implementation builds the same layer (same seed, so the same weights) and runs it on
the same inputs (``jax.random.key(1)``). ``--smoke``: the tiny preset with ``index_topk=8``
(each query keeps 2 pools of 4 tokens and its tail: a real choice from 12 tokens on, and a
sparse indexer loss over 2 pools, not a softmax over one that is constant), layer 1, tiles of
8, pages of 32 tokens (the whole 8-pool tiles the Mosaic paged scorer copies), 24 prefill
tokens and 16 for the gradients, implementations ``pallas_interpret`` (and
``mosaic_interpret`` on jax >= 0.11) and ``auto``. ``--parts`` runs some of the parts below.

**Rows.** Each is ``dict(part, impl, check, time_ms, details)``; ``check`` is ``reference``,
``ok (...)``, ``MISMATCH ...``, ``error: ...`` (an exception in that row: the run goes on) or
``skipped (...)`` (the ``--budget`` seconds, default 150, are spent, or nothing to compare with).

* ``prefill``: a batch of 2 x N tokens (``--tokens``, default 4096; row 1 left-padded by 5)
  into an empty contiguous cache of N + 8 slots (``layer.init_cache``). ``decode``: 4 steps of
  one token each on the filled cache. ``paged prefill`` / ``paged decode``: the same through a
  paged cache (``layer.init_paged_cache``, pages of ``--page-size`` tokens, just enough pages
  for both sequences); its top-k are positions within each sequence.

  **The rule: against float32.** Each part first runs the same layer in float32 (its bf16
  weights cast, float32 compute and cache, the inputs cast, every dot at ``HIGHEST``); every
  row then carries ``out_err_f32`` (``max |out - out_f32| / max |out_f32|`` over valid rows)
  and ``miss_f32`` (the share of float32's selected tokens, over valid rows, that the row's
  top-k does not hold). An implementation passes when ``out_err_f32 <= max(F32_RATIO x
  xla's, OUT_FLOOR)`` and ``miss_f32 <= max(F32_RATIO x xla's, MISS_FLOOR)`` (1.5, 1e-2,
  0.1 %), bf16 ``"xla"`` being the baseline (``judge_f32``). Why not bf16 against bf16: two
  right bf16 layers differ near every selection cutoff. On an H200 (2026-12-04) ``pallas``
  and ``mosaic`` each differed from ``"xla"`` in 1,607 of 8,187 prefill rows (2 beyond the
  tie window below), because ``kpool_compress`` rounds a pooled key a bf16 ulp apart from
  ``"xla"``'s here and there, while ``mosaic`` and ``"xla"`` each missed 0.09 % of float32's tokens.

  Also reported (and the rule when the float32 run did not fit ``--budget``), against
  ``"xla"``'s rows of the same part:

  - outputs (valid rows): ``max |out - ref| / max |ref| <= OUT_TOL`` (2e-2): a few bf16 ulps of
    the largest output (both round the projections and the attention to bf16, in another
    order); a wrong token, head or mask moves outputs by O(0.1-1).
  - top-k (every valid query row): the same token ids. A row whose ids differ passes only at
    a tie: both sides keep as many whole candidate pools and the same tail tokens, and every
    pool kept by one side only scores, by ``"xla"``'s own indexer (``selection_scores`` over
    prompt + decode tokens), within ``SCORE_TIE`` (2**-8, one bf16 ulp) of the row's largest
    score from ``"xla"``'s cutoff (its lowest kept score). ``details``: ``topk_rows`` (valid
    query rows), ``topk_scored_rows`` (rows that see more than ``select_k`` pools, where the
    top-k is a choice; GLM-5.3-Flash keeps 512 pools = 2,048 tokens, so at N <= 2048 no prefill
    row chooses: the default N is 4096), ``topk_rows_differ`` (id sets differ),
    ``topk_rows_untied`` (differ beyond a tie: the failures), ``topk_rows_order`` (same set,
    other order: not a failure).
  - ``details["kernels"]``: the kernels in the compiled program, counted in its lowered text
    (``mosaic_gpu`` custom calls, Triton calls by name; none in interpret mode).

  ``time_ms``: ``prefill`` the median of ``--reps`` calls (3) after a warm-up one (the compile is
  ``details["compile_s"]``; ``--smoke``: the first call's time, interpret mode is slow);
  ``decode`` the median of the 4 steps (each one synced call).
* ``grad out`` / ``grad indexer_loss``: jitted ``jax.value_and_grad`` (of the layer's
  parameters, split with ``nnx.split``: what ``nnx.value_and_grad`` computes) of (a)
  ``sum(out * ct)`` in float32 with a fixed random bf16 cotangent ``ct``, and (b) the layer's
  ``indexer_loss="sparse"`` (docs/training.md), batch 1, N tokens (``--grad-tokens``, default
  1024), all valid. Rows: ``xla f32`` (the reference: the same layer with float32 parameters,
  the bf16 ones cast, and float32 compute, under ``"xla"``, on the same inputs, every dot at
  ``HIGHEST`` precision, not a GPU's TF32), ``xla`` (bf16: the baseline) and each
  implementation (bf16). Per parameter tensor ``p``,
  ``err_i[p] = ||g_i[p] - g_f32[p]|| / ||g_f32[p]||``. **Rule** (the float32 rule,
  ``glm5_dsa_jax/tools/float32_rule.py``, which says why): implementation ``i`` passes when
  for every ``p`` ``err_i[p] <= max(RATIO * err_xla[p], GRAD_FLOOR)`` (1.5, 1e-2); where ``g_f32[p]`` is
  exactly zero (the indexer under the output loss, every other tensor under the indexer loss),
  ``g_i[p]`` must be exactly zero; a non-finite gradient fails. The ``xla`` row itself fails
  only on a non-finite gradient or a zero pattern unlike float32's; the ``xla f32`` row fails
  when its gradient is zero everywhere (nothing would be compared). ``details``: the worst
  tensor (the largest ``err_i / limit``), every tensor's error, the global norm ratio
  ``||g_i - g_f32|| / ||g_f32||`` over all tensors, and the loss values. ``time_ms`` as
  ``prefill``'s.
* ``auto``: the layer built with ``implementation="auto"``: what it resolved to
  (``layer.implementation``) and the kernels its prefill and decode programs hold. ``ok`` when
  they are the resolved implementation's: ``mosaic``: a ``mosaic_gpu`` custom call;
  ``pallas``: Triton calls and no Mosaic one; ``xla`` (a CPU, e.g. ``--smoke``): neither.
  ``auto`` also gets ``prefill`` / ``decode`` rows like any implementation; its other parts are
  skipped when it resolved to an implementation already in ``--impls`` (the same program).

Exit status: 0 when no check failed (``skipped`` rows are not failures), 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import glm5_dsa_jax as gd  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from glm5_dsa_jax.tools import float32_rule  # noqa: E402

#: Outputs: max |out - ref| / max |ref| over valid rows (module doc).
OUT_TOL = 2e-2
#: Top-k: two pools whose ``"xla"`` scores are this close, relative to the row's largest
#: |score|, are a tie at the cutoff (one bf16 ulp; another order of float32 sums is ~1e-6).
SCORE_TIE = 2.0**-8
#: Prefill / decode against float32 (module doc): an implementation's output error and the
#: share of float32's selected tokens it misses, each at most F32_RATIO times the bf16
#: ``"xla"`` path's own or under its floor.
F32_RATIO = 1.5
OUT_FLOOR = 1e-2
MISS_FLOOR = 1e-3

SEED, INPUT_SEED = 0, 1
DECODE_STEPS = 4
CACHE_SPARE = 8  # contiguous cache: N + CACHE_SPARE slots
PADS = (0, 5)  # left padding of each prefill row
SMOKE_PADS = (0, 3)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


# ------------------------------------------------------------------------------ checks
def out_error(got, want, live) -> float:
    """``max |got - want| / max |want|`` over the ``live [B, S]`` rows (inf if not finite)."""
    g = np.asarray(got, np.float32)[np.asarray(live)]
    w = np.asarray(want, np.float32)[np.asarray(live)]
    if g.shape != w.shape or not np.isfinite(g).all():
        return math.inf
    return float(np.abs(g - w).max(initial=0.0) / max(float(np.abs(w).max(initial=0.0)), 1e-30))


def _pools_and_tail(ids, cand, first_key: int, kpool: int):
    """``(chosen [P] bool, tail ids)`` of one selection row: the candidate pools (``cand``)
    whose ``kpool`` tokens are all in ``ids``, and the ids outside them; None when the row
    repeats a token."""
    ids = ids[ids >= 0]
    uniq = np.unique(ids)
    if uniq.size != ids.size:
        return None
    pool = (uniq - first_key) // kpool
    inside = (uniq >= first_key) & (pool < cand.size)
    counts = np.bincount(pool[inside], minlength=cand.size)
    chosen = cand & (counts == kpool)
    in_chosen = np.zeros(uniq.shape, bool)
    in_chosen[inside] = chosen[pool[inside]]
    return chosen, uniq[~in_chosen]


def _tie_only(got_ids, want_ids, row_scores, first_key: int, kpool: int) -> bool:
    """Whether one query row's two selections (token slots) differ only at a tie, judged by
    the reference's scores ``row_scores [P]`` (``-inf``: not a candidate) over pools that
    start at slot ``first_key`` (module doc)."""
    cand = np.isfinite(row_scores)
    got, want = _pools_and_tail(got_ids, cand, first_key, kpool), _pools_and_tail(want_ids, cand, first_key, kpool)
    if got is None or want is None:
        return False
    (chosen_g, tail_g), (chosen_w, tail_w) = got, want
    if chosen_g.sum() != chosen_w.sum() or not np.array_equal(tail_g, tail_w):
        return False  # a different count of pools, or other tail tokens: no tie explains it
    if not chosen_w.any():
        return True
    cutoff = row_scores[chosen_w].min()
    tol = SCORE_TIE * np.abs(row_scores[cand]).max()
    return bool(np.all(np.abs(row_scores[chosen_g ^ chosen_w] - cutoff) <= tol))


def compare_topk(got, want, live, scores_fn, first_key, kpool: int) -> dict:
    """Counts of the module doc's top-k check over the ``live [B, T]`` rows of ``got`` and
    ``want`` (``[B, T, W]`` token slots, -1: none). ``scores_fn()`` returns the reference's
    ``[B, T, P]`` scores (called only when some row's ids differ)."""
    got, want, live = np.asarray(got), np.asarray(want), np.asarray(live, bool)
    res = dict(topk_rows=int(live.sum()), topk_rows_differ=0, topk_rows_untied=0, topk_rows_order=0)
    if got.shape != want.shape:
        res.update(topk_rows_differ=res["topk_rows"], topk_rows_untied=res["topk_rows"])
        return res
    differ = live & (got != want).any(-1)
    scores = None
    for b, t in zip(*np.nonzero(differ)):
        if np.array_equal(np.sort(got[b, t]), np.sort(want[b, t])):
            res["topk_rows_order"] += 1
            continue
        res["topk_rows_differ"] += 1
        scores = scores_fn() if scores is None else scores
        if not _tie_only(got[b, t], want[b, t], scores[b, t], int(first_key[b]), kpool):
            res["topk_rows_untied"] += 1
    return res


def judge_f32(got: dict, base: dict) -> str:
    """The float32 rule of prefill / decode (module doc) on an implementation's distances
    from the float32 run (``got``: ``out_err_f32``, ``miss_f32``) and the bf16 ``"xla"``
    run's (``base``): ``ok (...)`` or ``MISMATCH (...)``."""
    lim_out = max(F32_RATIO * base["out_err_f32"], OUT_FLOOR)
    lim_miss = max(F32_RATIO * base["miss_f32"], MISS_FLOOR)
    ok = got["out_err_f32"] <= lim_out and got["miss_f32"] <= lim_miss
    return (f"{'ok' if ok else 'MISMATCH'} vs float32: out {got['out_err_f32']:.1e} (xla {base['out_err_f32']:.1e}, "
            f"limit {lim_out:.1e}), misses {got['miss_f32']:.2%} of its tokens (xla {base['miss_f32']:.2%}, "
            f"limit {lim_miss:.2%})")


def count_kernels(text: str) -> dict:
    """The kernels of a lowered program: ``mosaic_gpu`` custom calls, Triton calls by name."""
    return dict(mosaic_gpu=text.count("custom_call @mosaic_gpu"),
                triton=dict(collections.Counter(c["name"] for c in pk.triton_calls(text))))


def flat_params(state) -> dict:
    """A parameter (gradient) state as ``{"a/b": numpy array}``."""
    out = {}

    def walk(d, path):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, path + (str(k),))
            elif v is not None:
                out["/".join(path + (str(k),))] = np.asarray(v)

    walk(nnx.to_pure_dict(state), ())
    return out


# ------------------------------------------------------------------------------ setup
class Setup:
    """The layer, its inputs and the run's settings (module doc)."""

    def __init__(self, smoke: bool, tokens: int | None, grad_tokens: int | None, page_size: int | None,
                 reps: int | None):
        if smoke:
            self.cfg = gd.DsaConfig.tiny(index_topk=8)
            self.layer_idx, self.block_q, self.pads = 1, 8, SMOKE_PADS
        else:
            self.cfg = gd.DsaConfig.preset("glm53-flash")
            self.layer_idx, self.block_q, self.pads = self.cfg.dsa_layers[0], 64, PADS
        self.tokens = tokens or (24 if smoke else 4096)
        self.grad_tokens = grad_tokens or (16 if smoke else 1024)
        self.page_size = page_size or (32 if smoke else 64)
        self.reps = (0 if smoke else 3) if reps is None else reps
        cfg, n, b = self.cfg, self.tokens, len(self.pads)
        if n + CACHE_SPARE > cfg.max_position_embeddings or self.page_size % cfg.index_kpool:
            raise ValueError(f"--tokens {n} + {CACHE_SPARE} must fit max_position_embeddings "
                             f"{cfg.max_position_embeddings} and --page-size {self.page_size} divide "
                             f"by index_kpool {cfg.index_kpool}")
        ks = jax.random.split(jax.random.key(INPUT_SEED), 4)
        bf = jnp.bfloat16
        self.x = jax.random.normal(ks[0], (b, n, cfg.hidden_size), jnp.float32).astype(bf)
        self.mask = jnp.arange(n)[None, :] >= jnp.asarray(self.pads)[:, None]
        self.x_dec = jax.random.normal(ks[1], (DECODE_STEPS, b, 1, cfg.hidden_size), jnp.float32).astype(bf)
        self.mask_dec = jnp.ones((b, 1), bool)
        g = self.grad_tokens
        self.x_grad = jax.random.normal(ks[2], (1, g, cfg.hidden_size), jnp.float32).astype(bf)
        self.ct = jax.random.normal(ks[3], (1, g, cfg.hidden_size), jnp.float32).astype(bf).astype(jnp.float32)
        self.first_key = np.asarray(self.pads)
        # Query rows (prefill, then the decode steps) that see more than select_k pools.
        t = np.arange(n + DECODE_STEPS)[None, :]
        seen = (t - self.first_key[:, None] + 1) // cfg.index_kpool
        live = np.concatenate([np.asarray(self.mask), np.ones((b, DECODE_STEPS), bool)], 1)
        self.scored = live & (seen > cfg.max_select_k)

    def layer(self, impl: str, dtype=jnp.bfloat16) -> gd.DsaAttention:
        return gd.DsaAttention(self.cfg, self.layer_idx, rngs=nnx.Rngs(SEED), implementation=impl,
                               dtype=dtype, param_dtype=dtype, block_q=self.block_q)

    def cache(self, layer, kind: str):
        b, n = len(self.pads), self.tokens + CACHE_SPARE
        if kind == "contiguous":
            return layer.init_cache(b, n)
        return layer.init_paged_cache(b, num_pages=b * -(-n // self.page_size), page_size=self.page_size)


def _compile(fn, *args):
    """``(compiled, lowered text, seconds)`` of ``jax.jit(fn)`` at ``args``."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    text = lowered.as_text()
    return lowered.compile(), text, time.perf_counter() - t0


def _call_and_time(fn, args, reps: int):
    """``(output of the first call, ms)``: the median of ``reps`` more calls, or with
    ``reps=0`` the first call's own time (the smoke run's: interpret mode is slow)."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = 1e3 * (time.perf_counter() - t)
    return out, (_median_ms(fn, args, reps) if reps else first)


def _median_ms(fn, args, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


# ------------------------------------------------------------------------------ the run
class Runner:
    def __init__(self, setup: Setup, impls, budget: float, verbose: bool = False, log=log):
        self.s, self.impls, self.budget, self.verbose, self.log = setup, list(impls), budget, verbose, log
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.failed = False
        self.resolved: dict[str, str] = {}  # impl -> what its layer resolved to ("auto")
        self._scores = None
        self._f32_base: dict = {}  # (cache kind, phase) -> the bf16 xla run's distance from float32

    def out_of_time(self) -> bool:
        return time.monotonic() - self.t0 > self.budget

    def add(self, part, impl, check, time_ms=None, **details) -> dict:
        row = dict(part=part, impl=impl, check=check, time_ms=time_ms, details=details)
        self.rows.append(row)
        self.failed |= check.startswith(("MISMATCH", "error"))
        t = "-" if time_ms is None else f"{time_ms:.2f} ms"
        self.log(f"  {part:<18} {impl:<18} {t:>12}  {check}")
        return row

    def error(self, part, impl, e: BaseException) -> None:
        if self.verbose:
            traceback.print_exception(e, file=sys.stderr)
        self.add(part, impl, f"error: {first_line(e)}")

    def skip_auto(self, impl: str) -> str | None:
        """Why ``impl`` gets no rows in this part: ``auto`` resolved to one checked anyway."""
        r = self.resolved.get(impl)
        if impl == "auto" and r is not None and (r == "xla" or r in self.impls):
            return f"skipped (auto resolved to {r!r}: its rows are the same program)"
        return None

    def ref_scores(self):
        """``"xla"``'s indexer scores ``[B, N + steps, P]`` over prompt + decode tokens."""
        if self._scores is None:
            s = self.s
            x = jnp.concatenate([s.x, jnp.concatenate(list(s.x_dec), axis=1)], axis=1)
            mask = jnp.concatenate([s.mask, jnp.ones((len(s.pads), DECODE_STEPS), bool)], axis=1)
            scores, _ = s.layer("xla").selection_scores(x, mask)
            self._scores = np.asarray(scores)
        return self._scores

    # ---------------------------------------------------------------- prefill + decode
    def cache_run(self, impl: str, kind: str, float32: bool = False) -> dict:
        """Prefill then ``DECODE_STEPS`` decode steps of ``impl``'s layer on a ``kind`` cache
        (``float32``: the bf16 layer's weights cast to float32, float32 compute and cache,
        the inputs cast, every dot at ``HIGHEST``: the reference of the module doc)."""
        s = self.s
        layer = s.layer(impl)
        self.resolved[impl] = layer.implementation
        x, x_dec = s.x, s.x_dec
        if float32:
            params = jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(layer, nnx.Param))
            layer = s.layer(impl, jnp.float32)
            nnx.update(layer, params)
            x, x_dec = x.astype(jnp.float32), x_dec.astype(jnp.float32)
        graphdef, state = nnx.split(layer)

        def call(state, x, mask, cache):
            with jax.default_matmul_precision("highest" if float32 else None):
                return nnx.merge(graphdef, state)(x, attention_mask=mask, cache=cache)

        cache0 = s.cache(layer, kind)
        prefill, text_p, c_p = _compile(call, state, x, s.mask, cache0)
        (out, topk, cache), t_prefill = _call_and_time(prefill, (state, x, s.mask, cache0), s.reps)
        if kind == "paged" and np.asarray(cache.status).any():
            raise RuntimeError(f"paged cache status after prefill: {np.asarray(cache.status).tolist()}")
        res = dict(prefill=dict(out=np.asarray(out), topk=np.asarray(topk), ms=t_prefill,
                                compile_s=round(c_p, 2), kernels=count_kernels(text_p)))
        try:
            decode, text_d, c_d = _compile(call, state, x_dec[0], s.mask_dec, cache)
            outs, topks, times = [], [], []
            for k in range(DECODE_STEPS):
                t = time.perf_counter()
                o, tk, cache = jax.block_until_ready(decode(state, x_dec[k], s.mask_dec, cache))
                times.append(time.perf_counter() - t)
                outs.append(np.asarray(o))
                topks.append(np.asarray(tk))
        except Exception as e:  # noqa: BLE001 - the prefill's row stands; the decode's is an error
            res["decode"] = e
            return res
        res["decode"] = dict(out=np.concatenate(outs, 1), topk=np.concatenate(topks, 1),
                             ms=1e3 * statistics.median(times), compile_s=round(c_d, 2),
                             kernels=count_kernels(text_d))
        return res

    def _slots(self, ids, kind):
        """Top-k ids as contiguous-cache slots (a paged cache's are sequence positions)."""
        if kind == "contiguous":
            return ids
        pad = self.s.first_key[:, None, None]
        return np.where(ids >= 0, ids + pad, -1)

    def _live(self, phase):
        s, n = self.s, self.s.tokens
        if phase == "prefill":
            return np.asarray(s.mask), slice(0, n)
        return np.ones((len(s.pads), DECODE_STEPS), bool), slice(n, n + DECODE_STEPS)

    def _judge_cache(self, got, ref, kind, phase) -> tuple[str, dict]:
        """The check text and details of one ``phase`` (``"prefill"`` / ``"decode"``) of
        ``got`` against ``ref`` (``cache_run``'s results): bf16 against bf16, the output
        within ``OUT_TOL`` and the top-k equal but at ties."""
        s = self.s
        live, rows = self._live(phase)
        err = out_error(got["out"], ref["out"], live)
        top = compare_topk(self._slots(got["topk"], kind), self._slots(ref["topk"], kind), live,
                           lambda: self.ref_scores()[:, rows], s.first_key, s.cfg.index_kpool)
        top["topk_scored_rows"] = int(s.scored[:, rows].sum())
        ok = err <= OUT_TOL and top["topk_rows_untied"] == 0
        text = (f"max|d|/max|ref| {err:.1e}, top-k: {top['topk_rows_differ']} of {top['topk_rows']} "
                f"rows differ ({top['topk_rows_untied']} beyond a tie; {top['topk_scored_rows']} choose)")
        return ("ok (" + text + ")") if ok else ("MISMATCH " + text), dict(out_rel_err=err, **top)

    def against_f32(self, got, ref32, kind, phase) -> dict:
        """``got``'s distance from the float32 run ``ref32``: ``out_err_f32`` (as
        ``out_error``) and ``miss_f32``, the share of float32's selected tokens (over the
        live rows) that ``got`` does not select."""
        live, _ = self._live(phase)
        g, w = self._slots(got["topk"], kind), self._slots(ref32["topk"], kind)
        missed = total = 0
        for b, t in zip(*np.nonzero(live)):
            want = w[b, t][w[b, t] >= 0]
            total += want.size
            missed += int(np.count_nonzero(~np.isin(want, g[b, t])))
        return dict(out_err_f32=out_error(got["out"], ref32["out"], live),
                    miss_f32=missed / max(total, 1))

    def cache_part(self, kind: str) -> None:
        part = "prefill" if kind == "contiguous" else "paged prefill"
        dpart = "decode" if kind == "contiguous" else "paged decode"
        ref = ref32 = None
        if not self.out_of_time():
            self.log(f"{part} + decode: xla f32")
            try:
                ref32 = self.cache_run("xla", kind, float32=True)
            except Exception as e:  # noqa: BLE001 - the bf16 comparisons still run
                self.error(part, "xla f32", e)
        for impl in ["xla"] + self.impls:
            why = self.skip_auto(impl) if kind == "paged" else None
            if why is None and self.out_of_time():
                why = "skipped (time budget)"
            if why is None and impl != "xla" and ref is None:
                why = "skipped (no xla reference)"
            if why is not None:
                self.add(part, impl, why)
                self.add(dpart, impl, why)
                continue
            self.log(f"{part} + decode: {impl}")
            try:
                got = self.cache_run(impl, kind)
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                self.error(part, impl, e)
                self.add(dpart, impl, "skipped (its prefill failed)")
                continue
            for p, phase in ((part, "prefill"), (dpart, "decode")):
                res = got[phase]
                if isinstance(res, BaseException):
                    self.error(p, impl, res)
                    continue
                extra = dict(compile_s=res["compile_s"], kernels=res["kernels"], resolved=self.resolved[impl])
                r32 = None if ref32 is None or isinstance(ref32[phase], BaseException) else ref32[phase]
                if r32 is not None:
                    extra.update(self.against_f32(res, r32, kind, phase))
                if impl == "xla":
                    base = self._f32_base.setdefault((kind, phase), extra if r32 is not None else None)
                    self.add(p, impl, "reference" + (
                        f" (vs float32: out {base['out_err_f32']:.1e}, misses {base['miss_f32']:.2%} of its tokens)"
                        if base else ""), res["ms"], **extra)
                    continue
                if isinstance(ref[phase], BaseException):
                    self.add(p, impl, "skipped (no xla reference)", res["ms"], **extra)
                    continue
                try:
                    check, details = self._judge_cache(res, ref[phase], kind, phase)
                    base = self._f32_base.get((kind, phase))
                    if r32 is not None and base is not None:
                        check = judge_f32(extra, base) + "; vs bf16 xla: " + check
                except Exception as e:  # noqa: BLE001
                    self.error(p, impl, e)
                    continue
                self.add(p, impl, check, res["ms"], **details, **extra)
            if impl == "xla":
                ref = got

    # ---------------------------------------------------------------- gradients
    def grad_fn(self, layer, loss: str, params=None):
        """``(value_and_grad(f), params)``: ``f(params, x, ct)`` the loss of ``layer``
        w.r.t. its parameters (``params`` replaces the layer's own, e.g. float32 copies)."""
        graphdef, own, rest = nnx.split(layer, nnx.Param, ...)
        mask = jnp.ones(self.s.x_grad.shape[:2], bool)

        def f(params, x, ct):
            module = nnx.merge(graphdef, params, rest)
            if loss == "out":
                out, _ = module(x, attention_mask=mask)
                return jnp.sum(out.astype(jnp.float32) * ct)
            return module(x, attention_mask=mask, indexer_loss="sparse")[2]

        return jax.value_and_grad(f), own if params is None else params

    def grads_of(self, impl: str, loss: str, float32: bool = False):
        """``(loss value, {tensor: gradient}, ms, compile s, kernels)`` of ``impl``'s layer."""
        s = self.s
        layer = s.layer(impl)
        self.resolved[impl] = layer.implementation
        x, params = s.x_grad, None
        if float32:
            params = jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(layer, nnx.Param))
            layer, x = s.layer(impl, jnp.float32), x.astype(jnp.float32)
        f, params = self.grad_fn(layer, loss, params)
        # The float32 reference's dots at HIGHEST: a GPU's default float32 dot may be TF32.
        with jax.default_matmul_precision("highest" if float32 else None):
            compiled, text, c = _compile(f, params, x, s.ct)
        (value, grads), ms = _call_and_time(compiled, (params, x, s.ct), s.reps)
        return float(value), flat_params(grads), ms, round(c, 2), count_kernels(text)

    def grad_part(self, loss: str) -> None:
        part = f"grad {loss}"
        ref = base = None
        for impl in ["xla f32", "xla"] + self.impls:
            why = self.skip_auto(impl)
            if why is None and self.out_of_time():
                why = "skipped (time budget)"
            if why is None and impl != "xla f32" and (ref is None or (impl != "xla" and base is None)):
                why = "skipped (no reference)"
            if why is not None:
                self.add(part, impl, why)
                continue
            self.log(f"{part}: {impl}")
            try:
                value, grads, ms, comp, kern = self.grads_of(impl.split()[0], loss, float32=impl == "xla f32")
                extra = dict(value=value, compile_s=comp, kernels=kern, tokens=self.s.grad_tokens)
                if impl == "xla f32":
                    if not any(g.any() for g in grads.values()):
                        self.add(part, impl, "error: the float32 gradient is zero everywhere", ms, **extra)
                        continue
                    ref = (value, grads)
                    self.add(part, impl, "reference (float32)", ms, **extra)
                    continue
                errs = float32_rule.tensor_errors(grads, ref[1])
                ok, check, details = float32_rule.judge(errs, None if impl == "xla" else base)
                if impl == "xla":
                    base = errs
                self.add(part, impl, check, ms, **details, global_err=float32_rule.global_error(grads, ref[1]),
                         value_f32=ref[0], errs={k: float(f"{e:.3g}") for k, e in errs.items()}, **extra)
            except Exception as e:  # noqa: BLE001
                self.error(part, impl, e)

    # ---------------------------------------------------------------- auto
    def auto_row(self) -> None:
        """``auto``'s resolution and the kernels of its prefill / decode programs (those rows')."""
        rows = {r["part"]: r for r in self.rows if r["impl"] == "auto" and r["part"] in ("prefill", "decode")}
        if "auto" not in self.resolved or "kernels" not in rows.get("prefill", {}).get("details", {}):
            self.add("auto", "auto", "skipped (its prefill did not run)")
            return
        r = self.resolved["auto"]
        kern = [rows[p]["details"]["kernels"] for p in ("prefill", "decode") if "kernels" in rows.get(p, {}).get("details", {})]
        mosaic = sum(k["mosaic_gpu"] for k in kern)
        triton = sum(sum(k["triton"].values()) for k in kern)
        want = {"mosaic": mosaic > 0, "pallas": triton > 0 and mosaic == 0,
                "xla": triton == 0 and mosaic == 0}.get(r, False)
        dev = jax.devices()[0]
        text = f"resolved to {r!r} on {getattr(dev, 'device_kind', dev)}: {mosaic} mosaic_gpu, {triton} triton calls"
        self.add("auto", "auto", ("ok (" + text + ")") if want else "MISMATCH " + text,
                 resolved=r, mosaic_gpu=mosaic, triton=triton)


PARTS = ("prefill", "auto", "paged", "grad")


def default_impls(smoke: bool) -> list[str]:
    """``pallas``, ``mosaic`` (jax >= 0.11) and ``auto``; the interpret forms with ``smoke``."""
    impls = ["pallas_interpret" if smoke else "pallas"]
    if pk.jax_version() >= pk.MOSAIC_MIN_JAX:
        impls.append("mosaic_interpret" if smoke else "mosaic")
    return impls + ["auto"]


def run(impls=None, *, smoke: bool = False, parts=PARTS, tokens: int | None = None,
        grad_tokens: int | None = None, page_size: int | None = None, reps: int | None = None,
        budget: float | None = None, verbose: bool = False, log=log, settings: dict | None = None) -> list[dict]:
    """The rows of the module doc for ``impls`` (default ``default_impls(smoke)``) against
    ``"xla"``: ``parts`` of ``PARTS`` (``"prefill"``: the contiguous cache's prefill and decode,
    ``"paged"``: the paged cache's, ``"grad"``: both losses' gradients, ``"auto"``: its row),
    within ``budget`` seconds (None: no limit). ``ValueError`` for an unknown implementation
    or part, or settings the layer cannot take. ``settings``, a dict, gets the run's settings
    (preset, layer, tokens, ...)."""
    impls = [i for i in dict.fromkeys(default_impls(smoke) if impls is None else impls) if i != "xla"]
    for i in impls:
        pk.check_implementation(i)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; expected some of {list(PARTS)}")
    setup = Setup(smoke, tokens, grad_tokens, page_size, reps)
    if settings is not None:
        settings.update(preset="tiny" if smoke else "glm53-flash", layer=setup.layer_idx,
                        index_topk=setup.cfg.index_topk, index_kpool=setup.cfg.index_kpool,
                        block_q=setup.block_q, tokens=setup.tokens, pads=list(setup.pads),
                        decode_steps=DECODE_STEPS, page_size=setup.page_size,
                        grad_tokens=setup.grad_tokens, reps=setup.reps)
    runner = Runner(setup, impls, math.inf if budget is None else budget, verbose, log)
    steps = dict(prefill=[lambda: runner.cache_part("contiguous")],
                 auto=[runner.auto_row] if "auto" in impls else [],
                 paged=[lambda: runner.cache_part("paged")],
                 grad=[lambda: runner.grad_part("out"), lambda: runner.grad_part("indexer_loss")])
    for part in PARTS:
        for step in steps[part] if part in parts else ():
            try:
                step()
            except Exception as e:  # noqa: BLE001 - e.g. out of memory building the inputs
                runner.error("-", "-", e)
    return runner.rows


def _table(rows) -> str:
    lines = [("part", "impl", "time", "check")] + [
        (r["part"], r["impl"], "-" if r["time_ms"] is None else f"{r['time_ms']:.2f} ms", r["check"])
        for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[3] for line in lines)


def failed(rows) -> bool:
    return any(r["check"].startswith(("MISMATCH", "error")) for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny preset, interpret-mode implementations (any device; what the tests run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--impls", default=None,
                    help="comma-separated implementations checked against xla (default "
                         "pallas,mosaic,auto; pallas_interpret,mosaic_interpret,auto with --smoke; "
                         "mosaic* only on jax >= 0.11)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    ap.add_argument("--tokens", type=int, default=None,
                    help="prefill tokens a row (default 4096; 24 with --smoke)")
    ap.add_argument("--grad-tokens", type=int, default=None,
                    help="tokens of the gradient rows (default 1024; 16 with --smoke)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="tokens a page of the paged cache (default 64; 32 with --smoke)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed calls per row after the first (median; default 3; 0 with --smoke: "
                         "the first call's time)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run; what is left is skipped (default 150; none with "
                         "--smoke, which checks every row however loaded the machine is)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    if args.budget is None:
        args.budget = math.inf if args.smoke else 150.0
    split = lambda text: [i.strip() for i in text.split(",") if i.strip()]  # noqa: E731
    impls = default_impls(args.smoke) if args.impls is None else split(args.impls)
    bad = [i for i in impls if i not in pk.IMPLEMENTATIONS]
    if bad:
        ap.error(f"--impls: unknown {bad}; expected some of {list(pk.IMPLEMENTATIONS)}")
    dev = jax.devices()[0]
    meta = dict(jax=jax.__version__, backend=jax.default_backend(), device=getattr(dev, "device_kind", str(dev)),
                smoke=args.smoke, impls=impls, parts=split(args.parts), budget_s=args.budget)
    log(f"jax {meta['jax']} on {meta['backend']} ({meta['device']}), budget {args.budget:.0f} s")
    t0 = time.monotonic()
    try:
        rows = run(impls, smoke=args.smoke, parts=meta["parts"], tokens=args.tokens,
                   grad_tokens=args.grad_tokens, page_size=args.page_size, reps=args.reps,
                   budget=args.budget, verbose=args.verbose, settings=meta)
    except ValueError as e:
        ap.error(str(e))
    meta.update(elapsed_s=round(time.monotonic() - t0, 1), ok=not failed(rows))
    if args.json:
        print(json.dumps(dict(meta, rows=rows), indent=1, default=float))
    else:
        print(f"jax {meta['jax']}, {meta['device']}, {meta['elapsed_s']} s")
        print(_table(rows))
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
