"""Torch-free helpers the tests share: the tiny layers, batches, tolerances, parameter
comparisons and the tie-aware selection check.

* ``f32_layer``: a float32 ``DsaAttention`` (parameters and compute) with its own random
  weights from ``nnx.Rngs(seed)``; float32 so a comparison measures our arithmetic against
  a reference's, not bf16 rounding.
* ``hidden_states`` / ``padded_batch``: random hidden states from
  ``np.random.default_rng(seed)`` (float32), and left-padding masks; one generator and one
  draw, so a test's inputs stay the same numbers whichever helper builds them.
* ``jitted_call``: a layer's call under ``jax.jit``; ``fresh_dir``: a scratch checkpoint
  directory made anew.
* ``params_np`` / ``assert_trees_equal``: a layer's parameters as a pure dict of numpy
  arrays, and two such trees compared bit for bit (a refused load must change nothing).
* ``check_selection`` compares our top-k with HF's as *sets* of token ids per valid query
  row; where they differ, the only allowed cause is HF's arbitrary choice among pools
  whose scores tie at the cutoff (see ``test_hf_parity``'s module doc). It reads the
  layer's ``selection_scores`` under ``jax.jit``, one program per layer structure and
  shape (eagerly, every operation compiled anew per sequence length: seconds a call).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import glm5_dsa_jax as gd

# Float32 parity tolerance against HF; the error budget is in test_hf_parity's module doc.
ATOL = RTOL = 3e-5


def f32_layer(cfg, layer_idx: int = 1, seed: int = 0, **kw) -> gd.DsaAttention:
    """Layer ``layer_idx`` of ``cfg`` in float32 with random weights from ``nnx.Rngs(seed)``;
    ``kw`` go to ``DsaAttention`` (``implementation``, ``block_q``, another ``param_dtype``)."""
    kw.setdefault("dtype", jnp.float32)
    kw.setdefault("param_dtype", jnp.float32)
    return gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(seed), **kw)


def params_np(layer) -> dict:
    """The layer's parameters as a pure dict of numpy arrays (a snapshot: later writes to the
    layer do not change it)."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))


def assert_trees_equal(a, b) -> None:
    """Two trees of arrays (``params_np`` snapshots, say) equal bit for bit: same
    structure, same values."""
    jax.tree.map(np.testing.assert_array_equal, a, b)


def jitted_call(layer):
    """``(f, state)``: ``f(state, x, **kw)`` is ``layer(x, **kw)`` under ``jax.jit``, the
    layer split once and merged inside the trace (how a jitted model holds it)."""
    graphdef, state = nnx.split(layer)

    @jax.jit
    def f(state, x, **kw):
        return nnx.merge(graphdef, state)(x, **kw)

    return f, state


def fresh_dir(path: Path, copy_of: Path | None = None) -> Path:
    """``path`` made anew: removed if it exists (a module fixture's directory may hold it
    from an earlier test), then a copy of the tree ``copy_of``, or empty."""
    if path.exists():
        shutil.rmtree(path)
    if copy_of is None:
        path.mkdir()
    else:
        shutil.copytree(copy_of, path)
    return path


def hidden_states(cfg, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """``[batch, seq, hidden]`` float32 standard normal from ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, seq, cfg.hidden_size)).astype(np.float32)


def padded_batch(cfg, pads, seq, seed):
    """``(x, mask)``: ``hidden_states`` for ``len(pads)`` sequences of ``seq`` slots, row
    ``b`` left padded by ``pads[b]`` slots (numpy)."""
    x = hidden_states(cfg, len(pads), seq, seed)
    mask = np.ones((len(pads), seq), bool)
    for b, p in enumerate(pads):
        mask[b, :p] = False
    return x, mask


@functools.partial(jax.jit, static_argnums=0)
def _selection_scores(graphdef, state, x, mask):
    return nnx.merge(graphdef, state).selection_scores(x, mask)


def check_selection(cfg, layer, x, mask, ours, theirs):
    """Sets equal per valid row, or ours a valid top-k of the same scores (ties)."""
    scores, first_key = _selection_scores(*nnx.split(layer), jnp.asarray(x), jnp.asarray(mask))
    scores, first_key = np.asarray(scores), np.asarray(first_key)
    kp = cfg.index_kpool
    n_tied = 0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not mask[b, t]:
                assert (ours[b, t] == -1).all(), "padding query must select nothing"
                assert (theirs[b, t] == -1).all()
                continue
            a, h = set(ours[b, t][ours[b, t] >= 0]), set(theirs[b, t][theirs[b, t] >= 0])
            assert len(ours[b, t][ours[b, t] >= 0]) == len(a), "a row repeats a token"
            if a == h:
                continue
            n_tied += 1
            assert len(a) == len(h), (b, t, sorted(a), sorted(h))
            pool_of = lambda ids: {(i - first_key[b]) // kp for i in ids}
            row = scores[b, t]
            full_a = {p for p in pool_of(a) if 0 <= p < len(row) and np.isfinite(row[p])
                      and all(first_key[b] + p * kp + j in a for j in range(kp))}
            full_h = {p for p in pool_of(h) if 0 <= p < len(row) and np.isfinite(row[p])
                      and all(first_key[b] + p * kp + j in h for j in range(kp))}
            tail_a = a - {first_key[b] + p * kp + j for p in full_a for j in range(kp)}
            tail_h = h - {first_key[b] + p * kp + j for p in full_h for j in range(kp)}
            assert tail_a == tail_h, (b, t, sorted(tail_a), sorted(tail_h))
            assert len(full_a) == len(full_h)
            left_out = [row[p] for p in range(len(row)) if np.isfinite(row[p]) and p not in full_a]
            if left_out:
                assert min(row[p] for p in full_a) >= max(left_out) - 1e-5, (b, t)
    return n_tied
