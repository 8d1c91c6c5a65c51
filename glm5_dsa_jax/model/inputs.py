"""Checks of a DSA layer call's inputs, run before anything is computed or written.

Invariants:

* Every check raises ``ValueError`` naming the argument, its expected form and what was
  given, before any array is launched, written or donated: ``DsaAttention.__call__`` and
  ``decode.DsaDecoder`` run them on the host first (through ``DsaAttention.check_inputs``),
  so a refused call leaves the cache exactly as it was.
* Checks that need values (0/1 integer masks, a causal ``prev_topk``) run only on
  concrete arrays; under a trace only shapes and dtypes are checked, and the layer itself
  keeps a traced ``prev_topk`` causal (ids after a query's own slot are dropped).
* ``hidden_states`` comes back in the layer's compute dtype and ``attention_mask`` as bool
  (``None`` = every token valid); ``prev_topk`` as an int32 jax array (or ``None``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_dsa_jax.model.config import DsaConfig

__all__ = ["as_index_array", "check_causal_topk", "check_inputs", "check_position_ids"]


def as_index_array(prev_topk):
    """``prev_topk`` (a list, numpy or jax array, or None) as a jax array, or ``ValueError``."""
    if prev_topk is None or isinstance(prev_topk, jax.Array):
        return prev_topk
    try:
        arr = np.asarray(prev_topk)
    except (ValueError, TypeError) as e:
        raise ValueError(f"prev_topk must be an integer array [B, S, out_width]: {e}") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"prev_topk must be an integer array [B, S, out_width], got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("prev_topk holds values outside int32")
    return jnp.asarray(arr, jnp.int32)


def check_causal_topk(ids: np.ndarray, mask: np.ndarray, start) -> None:
    """Refuse a ``prev_topk`` whose valid queries name a slot after their own (the future)
    or a negative id other than ``-1`` (no token). Padding queries' rows are ignored.
    ``start``: the slot of the first query (an int: one timeline, the contiguous cache),
    or each query's own position ``[B, S]`` (a paged cache: positions per sequence)."""
    pos = np.asarray(start)
    pos = pos + np.arange(ids.shape[1])[None] if pos.ndim == 0 else pos
    bad = mask[..., None] & ((ids > pos[..., None]) | (ids < -1))
    if bad.any():
        b, q, j = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(
            f"prev_topk[{b}, {q}, {j}] = {int(ids[b, q, j])} but query {q} sits at slot "
            f"{int(pos[b if pos.shape[0] > 1 else 0, q])} (row {b}): ids must be -1 (no token) "
            f"or a slot <= the query's own (a shared layer never attends to the future); "
            f"{int(bad.sum())} such entries"
        )


def _check_mask(attention_mask, b: int, s: int) -> jax.Array:
    if attention_mask is None:
        return jnp.ones((b, s), bool)
    mask = jnp.asarray(attention_mask)
    if mask.shape != (b, s):
        raise ValueError(
            f"attention_mask must be [B, S] = {(b, s)} like hidden_states, got {tuple(mask.shape)}"
        )
    if mask.dtype != jnp.bool_:
        if not jnp.issubdtype(mask.dtype, jnp.integer):
            raise ValueError(f"attention_mask must be bool or 0/1 integers, got dtype {mask.dtype}")
        if not isinstance(mask, jax.core.Tracer):
            bad = np.setdiff1d(np.unique(np.asarray(mask)), [0, 1])
            if bad.size:
                raise ValueError(f"attention_mask must hold only 0 and 1, found {bad[:5].tolist()}")
        mask = mask != 0
    return mask


def check_inputs(cfg: DsaConfig, layer_idx: int, dtype, hidden_states, attention_mask=None,
                 prev_topk=None, *, start=None):
    """``(x, mask, prev_topk)`` of a call of layer ``layer_idx`` of ``cfg`` (compute dtype
    ``dtype``), after checking every input. A ``"full"`` layer refuses a ``prev_topk``; a
    ``"shared"`` one needs it, integer ``[B, S, out_width]``. ``start`` is the slot of the
    first query (the cache's length): with it, a concrete ``prev_topk`` is checked causal."""
    prev_topk = as_index_array(prev_topk)
    x = jnp.asarray(hidden_states)
    if x.ndim != 3 or x.shape[-1] != cfg.hidden_size:
        raise ValueError(
            f"hidden_states must be [B, S, hidden={cfg.hidden_size}], got shape {tuple(x.shape)}"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"hidden_states must be floating point, got {x.dtype}")
    b, s, _ = x.shape
    if s == 0 or b == 0:
        raise ValueError(f"hidden_states has an empty batch or sequence: {tuple(x.shape)}")
    mask = _check_mask(attention_mask, b, s)
    if cfg.has_indexer(layer_idx):
        if prev_topk is not None:
            raise ValueError(
                f"layer {layer_idx} runs its own indexer; prev_topk is only for 'shared' layers"
            )
    else:
        if prev_topk is None:
            raise ValueError(
                f"layer {layer_idx} is a 'shared' indexer layer: pass prev_topk, the "
                "top-k of the previous 'full' layer"
            )
        if prev_topk.shape != (b, s, cfg.out_width) or not jnp.issubdtype(prev_topk.dtype, jnp.integer):
            raise ValueError(
                f"prev_topk must be integer [B, S, out_width] = {(b, s, cfg.out_width)}, "
                f"got {prev_topk.dtype} {tuple(prev_topk.shape)}"
            )
        concrete = not any(isinstance(a, jax.core.Tracer) for a in (prev_topk, mask, start))
        if start is not None and concrete:
            check_causal_topk(np.asarray(prev_topk), np.asarray(mask), int(start))
    return x.astype(dtype), mask, prev_topk


def check_position_ids(position_ids, shape) -> jax.Array:
    """``position_ids`` as ``[B, S]`` int32 for a call of ``shape = (B, S)`` (a ``[S]`` row is
    broadcast), else ``ValueError``."""
    pos = jnp.asarray(position_ids)
    if not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"position_ids must be integers, got dtype {pos.dtype}")
    if pos.ndim == 1:
        pos = jnp.broadcast_to(pos[None], (shape[0], pos.shape[0]))
    if tuple(pos.shape) != tuple(shape):
        raise ValueError(f"position_ids must be [B, S] = {tuple(shape)}, got {tuple(jnp.shape(position_ids))}")
    if not isinstance(pos, jax.core.Tracer) and bool((pos < 0).any()):
        raise ValueError("position_ids must be >= 0")
    return pos.astype(jnp.int32)
