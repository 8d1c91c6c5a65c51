"""Torch-free helpers the tests share: the tiny configs, layers, batches and meshes, the
tolerances, parameter comparisons and the tie-aware selection check (the HF oracle, which
needs torch, is ``hf_oracle``; Python 3.12 collects no module that imports it, so nothing
here may).

* ``tiny8``: ``DsaConfig.tiny`` with 8 heads, so every TP size up to 8 divides them;
  ``rope_tiny``: a small RoPE model (``glm_moe_dsa`` / ``deepseek_v32``, ``YARN`` scaling by
  default; a ``glm_moe_dsa`` one has a full then a shared layer).
* ``tp_mesh`` / ``dp_mesh``: a ``("tp",)`` or ``("data", "tp")`` mesh of the virtual CPU
  devices with ``Explicit`` (jax's default) or ``Auto`` axes.
* Tolerances, named by what they bound (each value is the one its tests were written with;
  a wrong token, head, row or mask moves outputs by O(0.1)): ``ATOL`` / ``RTOL`` (our float32
  layer against HF's), ``F32_REORDER`` (the same float32 ops summed in another order),
  ``F32_VS_F64`` (a float32 kernel against a float64 numpy oracle) and ``SCORE_TIE`` (how far
  apart two index scores may be and still count as a tie at the top-k cutoff).
* ``f32_layer``: a float32 ``DsaAttention`` (parameters and compute) with its own random
  weights from ``nnx.Rngs(seed)``; float32 so a comparison measures our arithmetic against
  a reference's, not bf16 rounding.
* ``hidden_states`` / ``padded_batch``: random hidden states from
  ``np.random.default_rng(seed)`` (float32), and left-padding masks; one generator and one
  draw, so a test's inputs stay the same numbers whichever helper builds them.
* ``jitted_call``: a layer's call under ``jax.jit``; ``fresh_dir``: a scratch checkpoint
  directory made anew.
* ``params_np`` / ``assert_trees_equal`` / ``assert_same_layers``: a layer's parameters as a
  pure dict of numpy arrays, two such trees compared bit for bit (a refused load must
  change nothing), and two dicts of layers compared so (a load is the layers saved).
* ``same_sets``: the rows where two selections name the same tokens (where an output must
  equal HF's). ``check_selection`` compares our top-k with HF's as *sets* of token ids per
  valid query row; where they differ, the only allowed cause is HF's arbitrary choice among
  pools whose scores tie at the cutoff (see ``test_hf_parity``'s module doc), judged by
  HF's own scores (``hf_oracle.hf_selection``), never by the layer under test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

import glm5_dsa_jax as gd
import pallas_kernels as pk

# Float32 parity tolerance against HF; the error budget is in test_hf_parity's module doc.
ATOL = RTOL = 3e-5
# The same float32 computation with its sums in another order: chunked vs one-shot prefill,
# a sharded ``o_proj``'s per-rank partial sums all-reduced (TP, data parallel, many hosts),
# an interpreted kernel's blocking vs XLA's, torch vs jax on one selection. Measured ~1e-6
# at the tiny widths (test_sharding's module doc); atol = rtol.
F32_REORDER = 1e-5
# A float32 kernel against a float64 numpy oracle on O(1) values: sparse MLA outputs are
# convex combinations of latent rows with logits up to ~30, so float32 exp / sum carry
# ~30 * 2**-24 * (a few) relative error per weight (measured up to 1.5e-6 on jax 0.12);
# index scores are sums of a few dozen float32 products; atol = rtol.
F32_VS_F64 = 1e-5
# Two float32 index scores this close are a tie at the top-k cutoff: a valid top-k may keep
# either (HF's ``torch.topk`` and our kernels order ties differently).
SCORE_TIE = 1e-5

# YaRN at test scale (factor 4 over 1024 original positions): the RoPE models' default.
YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
        "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny8(**kw) -> gd.DsaConfig:
    """``DsaConfig.tiny`` with 8 heads (every TP size up to 8 divides them), ``kw`` replaced."""
    return gd.DsaConfig.tiny(num_attention_heads=8, **kw)


def rope_tiny(model_type: str = "glm_moe_dsa", rope: dict = YARN, **kw) -> gd.DsaConfig:
    """A small RoPE model of ``model_type`` (cache row ``[c, k_rot]``, 24 + 8 wide), with
    ``rope`` as its ``rope_parameters`` and the HF config keys ``kw`` replaced; a
    ``glm_moe_dsa`` one has ``indexer_types = ["full", "shared"]``."""
    d = dict(model_type=model_type, hidden_size=32, num_attention_heads=2, q_lora_rank=16,
             kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6,
             index_n_heads=3, index_head_dim=12, index_topk=4, num_hidden_layers=2,
             max_position_embeddings=4096, rope_parameters=dict(rope))
    if model_type == "glm_moe_dsa":
        d["indexer_types"] = ["full", "shared"]
    return gd.DsaConfig.from_hf_config(d | kw)


def _mesh(shape, names, mode, devices=None):
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[mode]
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=devices)


def tp_mesh(n: int, mode: str = "explicit", name: str = "tp", devices=None):
    """A 1-D mesh of ``n`` devices (the first ``n`` unless ``devices``) on axis ``name``,
    ``mode`` ``"explicit"`` or ``"auto"``."""
    return _mesh((n,), (name,), mode, devices)


def dp_mesh(shape, mode: str = "explicit"):
    """A ``("data", "tp")`` mesh of ``shape`` over the first ``prod(shape)`` devices."""
    return _mesh(tuple(shape), ("data", "tp"), mode)


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


def assert_trees_equal(a, b, what: str = "") -> None:
    """Two trees of arrays (``params_np`` snapshots, say) equal bit for bit: same
    structure, same values (a difference names ``what`` and the leaf's path)."""
    jax.tree_util.tree_map_with_path(
        lambda path, x, y: np.testing.assert_array_equal(x, y, err_msg=f"{what}{jax.tree_util.keystr(path)}"),
        a, b)


def assert_same_layers(a: dict, b: dict) -> None:
    """Two ``{layer index: layer}`` dicts (loaded or restored checkpoints) with the same
    indices and bit-identical parameters (sharded ones gathered)."""
    assert sorted(a) == sorted(b)
    for i in a:
        assert_trees_equal(params_np(a[i]), params_np(b[i]), f"layer {i} ")


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


def same_sets(ours, theirs, live) -> np.ndarray:
    """``[...]`` bool: the ``live`` rows where our selection and theirs (``[..., W]`` token
    ids, ``-1`` for none; the widths may differ) name the same set of tokens."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    rows = zip(ours.reshape(-1, ours.shape[-1]), theirs.reshape(-1, theirs.shape[-1]))
    same = np.array([set(a[a >= 0]) == set(h[h >= 0]) for a, h in rows], bool)
    return same.reshape(ours.shape[:-1]) & live


def check_selection(cfg, mask, ours, hf) -> tuple[int, int, int]:
    """Our top-k ``ours [B, S, W]`` against HF's own selection ``hf`` (``hf_oracle.HfSelection``:
    the scores HF's indexer ranked, its candidates' tokens, its top-k and tail), per valid
    query row: ours is whole candidates plus HF's tail, as many candidates as HF's, and every candidate chosen by one side only
    scoring, by HF's scores, within ``SCORE_TIE`` of HF's cutoff (its lowest chosen score):
    only HF's arbitrary pick among tied candidates may differ. A padding query selects
    nothing. Returns ``(rows that differ at a tie, rows with more candidates than the
    top-k keeps, valid rows)``: a row of the second kind is where a wrong score shows, so
    callers assert there are many."""
    select_k = cfg.index_topk // cfg.index_kpool
    n_tied = n_sparse = n_rows = 0
    for b in range(ours.shape[0]):
        for t in range(ours.shape[1]):
            if not mask[b, t]:
                assert (ours[b, t] == -1).all(), "padding query must select nothing"
                continue
            n_rows += 1
            row, pools = hf.scores[b, t], hf.pools[b, t]
            cand = np.flatnonzero(np.isfinite(row))
            tokens = {int(q): {int(i) for i in pools[q] if i >= 0} for q in cand}
            a = ours[b, t][ours[b, t] >= 0]
            assert len(set(a)) == len(a), ("a row repeats a token", b, t)
            a, h = set(a.tolist()), set(hf.topk[b, t][hf.topk[b, t] >= 0].tolist())
            if cfg.index_kpool == 1:  # HF's torch.topk past the candidates names masked tokens
                h &= set().union(*tokens.values())
            chosen_a = {q for q, ids in tokens.items() if ids <= a}
            chosen_h = {q for q, ids in tokens.items() if ids <= h}
            tail = set(hf.tail[b, t][hf.tail[b, t] >= 0].tolist())  # HF's: whatever the scores
            covered = lambda chosen: set().union(tail, *(tokens[q] for q in chosen))  # noqa: E731
            assert covered(chosen_h) == h, ("HF's top-k read wrong", b, t, sorted(h))
            assert covered(chosen_a) == a, (b, t, sorted(a), sorted(h), sorted(tail))
            k = min(select_k, len(cand))
            assert len(chosen_a) == len(chosen_h) == k, (b, t, sorted(chosen_a), sorted(chosen_h), k)
            n_sparse += len(cand) > select_k
            if chosen_a != chosen_h:
                n_tied += 1
                cutoff = min(row[q] for q in chosen_h)
                for q in chosen_a ^ chosen_h:
                    assert abs(row[q] - cutoff) <= SCORE_TIE, (
                        f"row {b}, query {t}: candidate {q} (tokens {sorted(tokens[q])}) scores "
                        f"{row[q]:.7g} by HF's indexer, HF's cutoff is {cutoff:.7g}: no tie")
    return n_tied, n_sparse, n_rows


def paged_scores_both(rng, q, w, keys, q_pos, quantize, kpool: int):
    """``keys [B, P, D]`` (numpy; ``P`` a multiple of 4) in pages of 4 pools in a shuffled page
    order, quantised by ``quantize(pages) -> (values, scales)``, scored by
    ``pk.index_scores_paged`` under ``"xla"`` and ``"pallas_interpret"`` with random pool
    counts: ``(xla, pallas)`` scores as numpy."""
    import pallas_kernels as pk
    b, p, d = keys.shape
    table = rng.permutation(b * p // 4).reshape(b, p // 4).astype(np.int32)
    pages = np.zeros((b * p // 4, 4, d), np.float32)
    pages[table.reshape(-1)] = keys.reshape(b * p // 4, 4, d)
    values, scales = quantize(jnp.asarray(pages))
    counts = jnp.asarray(rng.integers(0, p + 1, b), jnp.int32)
    return tuple(np.asarray(pk.index_scores_paged(q, w, values, jnp.asarray(table), counts, q_pos, scales,
                                                  kpool=kpool, implementation=i))
                 for i in ("xla", "pallas_interpret"))


def check_cp8_decode_kernels(config, text, implementation, tp):
    """The kernel launches of GLM-5.3-Flash's decode step lowered for CUDA at cp 8 (a 1M-token
    cache of either kind; ``text`` the lowered module): ``"pallas"``: the Triton kernels in
    pipeline order, the scoring grid covering the shard's ``P / 8`` pools, the attention one
    program per ``block_h`` of the ``H / tp`` local heads; ``"mosaic"``: the two Triton
    kernels it keeps, Mosaic custom calls, and the shard's ``P / 8``-pool score row."""
    h = config.num_attention_heads // tp
    p_loc = (1 << 20) // config.index_kpool // 8
    calls = pk.triton_calls(text)
    names = [c["name"] for c in calls]
    if implementation == "pallas":
        assert names[:2] == ["kpool_compress", "index_scores"]
        assert names[-3:] == ["expand_selection", "sparse_mla", "sparse_mla_combine"], names
        assert set(names[2:-3]) == {"topk_pools_count", "topk_pools_compact"}, names
        assert np.prod(calls[1]["grid"]) * pk.IndexScoresBlockSizes().block_p == p_loc, calls[1]
        assert calls[-2]["grid"][0] == -(-h // pk.SparseMlaBlockSizes().block_h), calls[-2]
    else:
        assert names == ["kpool_compress", "expand_selection"], names
        assert "stablehlo.custom_call @mosaic_gpu" in text
        assert "tensor<1x" + f"{p_loc}xf32>" in text  # the shard's score row: P / 8 pools
