"""The float32 rule: how a 16-bit result (gradients first) is judged right.

Two bf16 runs of one computation differ by ~1e-2 even when both are right: every product
and norm is rounded to 8 bits, in each implementation's own order of summation. Compared
with each other, rounding and a fault look alike (the first H200 run's ``layer grads
pallas vs xla: MISMATCH (max err 2.0e-02)`` at 4K tokens could be either, issue 47). The
same computation in float32 on the same (bf16-valued) inputs is right to ~2**-24, so each
16-bit run's distance from it is that run's own error:

* ``"xla"`` in 16 bits (the baseline) measures how far rounding alone takes this
  computation on these inputs;
* an implementation that only sums in another order lands about as far: it passes when,
  for every tensor ``p``, ``err[p] <= max(RATIO * err_xla[p], floor)``; a wrong one lands
  much farther.

Invariants:

* ``err[p] = ||g[p] - g_f32[p]|| / ||g_f32[p]||`` (``tensor_errors``, float64 norms over the
  whole tensor: one rounded entry near the largest does not decide it, as a max would).
* Where ``g_f32[p]`` is exactly zero (a parameter the loss does not reach, a cache row no
  query selected) ``g[p]`` must be exactly zero: ``err[p]`` is 0 or inf. A non-finite entry
  or another shape is inf. Neither is ever within a limit.
* ``floor`` keeps a tensor that ``"xla"`` happens to get very close from failing another
  order of the same sums: ``GRAD_FLOOR`` for a whole layer's parameters (1e-2: norms,
  RoPE and a softmax between), ``KERNEL_FLOOR`` for one kernel's operands (2**-8: one
  bf16 rounding of the result is 2**-9 of an entry).
* The baseline itself (``judge(errs, None)``) fails only on a non-finite gradient or a
  zero pattern unlike float32's.

Used by the gradient tests (tests/test_grad_*.py), ``scripts/gpu_check_train.py``'s kernel
rows and ``scripts/gpu_check_layer.py``'s layer gradients.
"""

from __future__ import annotations

import math

import numpy as np

import jax

__all__ = ["RATIO", "GRAD_FLOOR", "KERNEL_FLOOR", "tensor_errors", "global_error", "judge", "against_float32"]

RATIO = 1.5
GRAD_FLOOR = 1e-2
KERNEL_FLOOR = 2.0**-8


def _leaves(tree) -> dict:
    """``{path: leaf}`` of a dict or pytree (a dict's own keys where it is flat)."""
    if isinstance(tree, dict) and all(not isinstance(v, (dict, list, tuple)) for v in tree.values()):
        return dict(tree)
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def tensor_errors(got, ref) -> dict:
    """Per tensor ``||got - ref|| / ||ref||`` (float64) of two pytrees of one structure;
    where ``ref`` is all zero: 0.0 if ``got`` is too, else inf; inf for a non-finite
    ``got`` or another shape."""
    got, ref = _leaves(got), _leaves(ref)
    errs = {}
    for k, w in ref.items():
        g, w = np.asarray(got[k], np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape or not np.isfinite(g).all():
            errs[k] = math.inf
            continue
        norm = float(np.linalg.norm(w))
        errs[k] = (0.0 if not g.any() else math.inf) if norm == 0.0 else float(np.linalg.norm(g - w)) / norm
    return errs


def global_error(got, ref) -> float:
    """``||got - ref|| / ||ref||`` over every tensor together."""
    got, ref = _leaves(got), _leaves(ref)
    num = sum(float(np.sum((np.asarray(got[k], np.float64) - np.asarray(w, np.float64)) ** 2))
              for k, w in ref.items())
    den = sum(float(np.sum(np.asarray(w, np.float64) ** 2)) for w in ref.values())
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def judge(errs: dict, errs_xla: dict | None, floor: float = GRAD_FLOOR) -> tuple[bool, str, dict]:
    """The rule on per-tensor errors (``tensor_errors``): ``(ok, check text, details)``.
    ``errs_xla=None`` judges the 16-bit ``"xla"`` baseline itself (finite, and exactly zero
    where float32's is)."""
    if errs_xla is None:
        bad = {k: e for k, e in errs.items() if not math.isfinite(e)}
        worst = max(errs, key=errs.get)
        details = dict(worst_param=worst, worst_err=errs[worst])
        if bad:
            return False, f"MISMATCH non-finite or not zero where float32's is: {sorted(bad)}", details
        return True, f"ok (bf16 baseline: worst {worst} {errs[worst]:.1e})", details
    limits = {k: max(RATIO * errs_xla[k], floor) for k in errs}
    ratio = {k: errs[k] / limits[k] for k in errs}
    worst = max(ratio, key=ratio.get)
    details = dict(worst_param=worst, worst_err=errs[worst], worst_err_xla=errs_xla[worst],
                   worst_limit=limits[worst])
    bad = sorted((k for k in errs if not errs[k] <= limits[k]), key=ratio.get, reverse=True)
    if bad:
        text = "; ".join(f"{k} {errs[k]:.1e} > {limits[k]:.1e} (xla {errs_xla[k]:.1e})" for k in bad[:3])
        return False, f"MISMATCH {len(bad)} of {len(errs)} tensors: {text}", details
    return True, (f"ok (worst {worst} {errs[worst]:.1e}, xla {errs_xla[worst]:.1e}, "
                  f"limit {limits[worst]:.1e})"), details


def against_float32(got, xla, ref32, floor: float = GRAD_FLOOR) -> tuple[bool, str, dict]:
    """``judge`` of ``got`` (an implementation's 16-bit result) with ``xla`` (the 16-bit
    ``"xla"`` result) as the baseline, both against ``ref32`` (float32 ``"xla"``);
    ``details["errs"]`` and ``details["errs_xla"]`` carry every tensor's error."""
    errs, errs_xla = tensor_errors(got, ref32), tensor_errors(xla, ref32)
    ok, text, details = judge(errs, errs_xla, floor)
    return ok, text, dict(details, errs=errs, errs_xla=errs_xla)
