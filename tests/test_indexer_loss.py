"""The indexer loss (``layer(x, attention_mask=mask, indexer_loss="dense" | "sparse")``),
``attention="dense"`` and the parameter filters (``glm5_dsa_jax.model.indexer_loss``).

Geometries: ``tiny8`` with odd widths (hidden 40, q_lora 23, kv_lora 37, nope 19, index
dim 13), two left-padded rows of 16 tokens (pads 0 and 5), query tiles of 8 (two tiles:
the tiles' ``lax.map`` and their ``jax.checkpoint`` run); ``KP4``: kpool 4 with the tail,
2 of up to 4 pools selected; ``KP1``: kpool 1, 5 of up to 16 tokens selected. What is
checked:

* The loss equals ``oracle_loss``, a float64 numpy computation of the issue's definition
  from the layer's parameters (its own projections, pooling, scores, attention; it calls no
  code of ours: the sparse mode takes only the layer's selection, a discrete output, as
  given), for ``"dense"`` and ``"sparse"`` under every implementation (``"mosaic_interpret"``
  on jax >= 0.11), to ``LOSS_TOL``.
* Sparse equals dense when every pool is selected (``index_topk`` covers the row).
* Gradient routing: the loss's gradient is exactly zero for ``x`` and every non-indexer
  parameter and non-zero for each indexer parameter; ``out``'s is exactly zero for every
  indexer parameter (with the loss computed in the same call). A frozen indexer
  (``nnx.DiffState(0, ATTENTION_PARAMS)``) runs no backward of the indexer: no transposed
  operation under its scopes in the gradient's program (the trainable indexer's has them).
* TP 2 and data x tp (2 x 2): the loss and its indexer gradients equal unplaced
  (``F32_REORDER``: the head mean's sum is a ``psum``).
* Memory: the dense loss's gradient at GLM-5.3-Flash dims (abstract parameters) has peak
  temporary bytes per token at 16K at most ``MEMORY_GROWTH`` times 4K's (no ``[S, S]``).
* ``attention="dense"`` equals a float64 masked dense MLA (every visible token), with the
  same ``topk`` as the sparse call; with a contiguous cache, a prefix then a chunk equals
  the one-shot call.
* Bad input: every ``ValueError`` of the issue, naming the argument.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glm5_dsa_jax as gd
from glm5_dsa_jax.model.indexer_loss import ATTENTION_PARAMS, INDEXER_PARAMS, indexer_param_mask
from glm5_dsa_jax.model.remat import policy as remat_policy
from helpers import F32_REORDER, F32_VS_F64, dp_mesh, f32_layer, padded_batch, params_np, tiny8, tp_mesh
from pallas_kernels._common import MOSAIC_MIN_JAX, jax_version

ODD = dict(hidden_size=40, q_lora_rank=23, kv_lora_rank=37, qk_nope_head_dim=19, index_head_dim=13)
CFGS = {"KP4": tiny8(index_topk=8, **ODD),
        "KP1": tiny8(index_kpool=1, index_kpool_always_select_tail=False, index_topk=5, **ODD)}
B, S, BLOCK_Q, PADS = 2, 16, 8, (0, 5)
IMPLS = ["xla", "pallas_interpret", pytest.param("mosaic_interpret", marks=[pytest.mark.mosaic, pytest.mark.skipif(
    jax_version() < MOSAIC_MIN_JAX,
    reason=f"Mosaic GPU kernels need jax >= {'.'.join(map(str, MOSAIC_MIN_JAX))} (this is jax {jax.__version__})")])]

#: The float32 loss against the float64 oracle: float32 logs / exps of the scores and of
#: the attention logits, ``F32_VS_F64``'s budget (measured up to 3e-8 on losses of 0.02-0.14).
LOSS_TOL = F32_VS_F64
#: Peak temporary bytes per token, 16K over 4K tokens (linear memory: flat per token;
#: measured 1.005). The per-token base is ~315 KB at GLM-5.3-Flash dims, so a quadratic
#: term shows as a few percent: the tiles' stacked ``[B, S, P]`` float32 score residuals
#: (the loss tiles not checkpointed) measured 1.09, a ``[B, S, S]`` float32 tensor would
#: add 48 KB per token (1.14), a ``[B, H, S, S]`` one hundreds of times more.
MEMORY_GROWTH = 1.05


# ---------------------------------------------------------------------------- oracle
def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _ln(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def _softmax(z, axis=-1):
    with np.errstate(invalid="ignore"):  # a row with no visible key: nan, zeroed by the caller
        z = z - z.max(axis, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis, keepdims=True)


def oracle(layer, x, mask):
    """Float64 numpy from the layer's parameters (a NoPE ``glm5_next`` layer): ``dict(a
    [B, S, H, S] attention logits, latent, scores [B, S, P] (nan = not a candidate),
    first_key [B], out_dense [B, S, hidden])``."""
    cfg = layer.cfg
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params_np(layer))
    ix = p["indexer"]
    x = np.where(mask[..., None], np.asarray(x, np.float64), 0.0)
    q_resid = _rms(x @ p["q_a_proj"], p["q_a_layernorm"], cfg.latent_norm_eps)
    q = np.einsum("bsr,rhd->bshd", q_resid, p["q_b_proj"])
    q_lat = np.einsum("bshd,hdc->bshc", q, p["w_uk"])
    latent = _rms(x @ p["kv_a_proj"], p["kv_a_layernorm"], cfg.latent_norm_eps)
    logits = np.einsum("bthc,bsc->bths", q_lat, latent) * cfg.softmax_scale
    # indexer
    kp, d = cfg.index_kpool, cfg.index_head_dim
    qi = np.einsum("bsr,rhd->bshd", q_resid, ix["wq_b"])
    wi = (x @ ix["weights_proj"]) * cfg.index_n_heads ** -0.5
    ki = _ln(x @ ix["wk"], ix["k_norm_scale"], ix["k_norm_bias"], cfg.index_norm_eps)
    gate = x @ ix["kpool_gate"]
    n_pools = max(1, S // kp)
    first_key = np.argmax(mask, 1)
    scores = np.full((B, S, n_pools), np.nan)
    for b in range(B):
        for j in range(n_pools):
            sl = first_key[b] + j * kp + np.arange(kp)
            if sl[-1] >= S or not mask[b, sl].all():
                continue
            pooled = (_softmax(gate[b, sl] + ix["kpool_ape"], 0) * ki[b, sl]).sum(0)
            for t in range(S):
                if mask[b, t] and sl[-1] <= t:
                    s = np.maximum(qi[b, t] @ pooled * d ** -0.5, 0.0)
                    scores[b, t, j] = wi[b, t] @ s
    # dense attention output (attention="dense"): every visible token
    vis = mask[:, None, :] & (np.arange(S)[None, :, None] >= np.arange(S)[None, None, :])  # [B, T, S]
    probs = _softmax(np.where(vis[:, :, None, :], logits, -np.inf))
    probs = np.where(mask[:, :, None, None], np.nan_to_num(probs), 0.0)
    o = np.einsum("bths,bsc->bthc", probs, latent)
    v = np.einsum("bthc,hvc->bthv", o, p["w_uv"])
    out = np.where(mask[..., None], np.einsum("bthv,hvo->bto", v, p["o_proj"]), 0.0)
    return dict(logits=logits, vis=vis, scores=scores, first_key=first_key, out_dense=out)


def _kl(mass, scores):
    """KL(mass / sum || softmax(scores)) of one query, float64."""
    pr = mass / mass.sum()
    lq = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
    pos = pr > 0
    return float((pr[pos] * (np.log(pr[pos]) - lq[pos])).sum())


def oracle_loss(layer, x, mask, mode, topk=None):
    """The issue's loss in float64: mean over loss queries of ``KL(p || q)``; ``"sparse"``
    over the pools of the layer's selection ``topk [B, S, W]`` (block ``k`` of a row: ids
    ``k*KP ...``, a pool when all ``KP`` are ids)."""
    r = oracle(layer, x, mask)
    kp = layer.cfg.index_kpool
    kls = []
    for b in range(B):
        for t in range(S):
            cand = np.flatnonzero(~np.isnan(r["scores"][b, t]))
            if not mask[b, t] or cand.size == 0:
                continue
            fk = r["first_key"][b]
            if mode == "dense":
                a = _softmax(np.where(r["vis"][b, t], r["logits"][b, t], -np.inf)).mean(0)  # [S]
                pools = cand
            else:
                ids = np.asarray(topk[b, t])
                valid = ids >= 0
                a_sel = _softmax(np.where(valid, r["logits"][b, t][:, np.where(valid, ids, 0)], -np.inf)).mean(0)
                a = np.zeros(S)
                np.add.at(a, ids[valid], a_sel[valid])
                blocks = ids[: (len(ids) // kp) * kp].reshape(-1, kp)
                pools = np.array([(blk[0] - fk) // kp for blk in blocks if (blk >= 0).all()])
            mass = np.array([a[fk + j * kp: fk + (j + 1) * kp].sum() for j in pools])
            kls.append(_kl(mass, r["scores"][b, t, pools]))
    return float(np.mean(kls)) if kls else 0.0


# ---------------------------------------------------------------------------- helpers
def make(cfg="KP4", implementation="xla", seed=1, **kw):
    return f32_layer(CFGS[cfg] if isinstance(cfg, str) else cfg, 1, seed=seed,
                     implementation=implementation, block_q=BLOCK_Q, **kw)


def batch(cfg="KP4"):
    c = CFGS[cfg] if isinstance(cfg, str) else cfg
    return padded_batch(c, PADS, S, seed=4)


def split_grad(layer, mode, wrt=nnx.Param, ct=None):
    """Jitted ``f(params, x) -> ((loss, (out, topk)), (dparams, dx))`` of ``loss`` (or of
    ``sum(out * ct)`` + ``loss`` when ``ct`` is given) w.r.t. the ``wrt`` parameters and ``x``."""
    graphdef, params, rest = nnx.split(layer, wrt, ...)
    _, mask = batch(layer.cfg)

    def f(params, x):
        out, topk, loss = nnx.merge(graphdef, params, rest)(x, attention_mask=mask, indexer_loss=mode)
        total = loss if ct is None else loss + jnp.sum(out * ct)
        return total, (loss, out, topk)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True)), params


def flat(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]
    return {tuple(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in leaves}


# ---------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("cfg", ["KP4", "KP1"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_loss_equals_float64_oracle(mode, cfg, implementation):
    layer = make(cfg, implementation)
    x, mask = batch(cfg)
    out, topk, loss = layer(x, attention_mask=mask, indexer_loss=mode)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    want = oracle_loss(layer, x, mask, mode, np.asarray(topk))
    print(f"loss {float(loss):.9g} oracle {want:.9g} error {abs(float(loss) - want):.3g}")
    np.testing.assert_allclose(float(loss), want, rtol=LOSS_TOL, atol=LOSS_TOL)
    assert want > 10 * LOSS_TOL  # a random indexer is away from the attention: the check can fail
    # the loss changes nothing else of the call
    out0, topk0 = layer(x, attention_mask=mask)
    np.testing.assert_array_equal(np.asarray(topk), np.asarray(topk0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out0))


def test_sparse_equals_dense_when_every_pool_is_selected():
    cfg = tiny8(index_topk=S, **ODD)  # select_k = every pool of the row
    layer = make(cfg)
    x, mask = batch(cfg)
    dense = layer(x, attention_mask=mask, indexer_loss="dense")[2]
    sparse = layer(x, attention_mask=mask, indexer_loss="sparse")[2]
    np.testing.assert_allclose(float(sparse), float(dense), rtol=F32_REORDER, atol=F32_REORDER)
    np.testing.assert_allclose(float(dense), oracle_loss(layer, x, mask, "dense"), rtol=LOSS_TOL, atol=LOSS_TOL)


def test_no_loss_query_gives_zero():
    layer = make()
    x, mask = padded_batch(CFGS["KP4"], (0, 1), 3, seed=4)  # 3 tokens: no complete pool of 4
    for mode in ("dense", "sparse"):
        loss = layer(x, attention_mask=mask, indexer_loss=mode)[2]
        assert float(loss) == 0.0


# ---------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.slow
def test_gradients_route_as_deepseek(mode, implementation):
    layer = make(implementation=implementation)
    x, mask = batch()
    f, params = split_grad(layer, mode)
    (_, (loss, _, _)), (grads, dx) = f(params, x)
    grads = flat(grads)
    assert not np.asarray(dx).any()
    if implementation != "xla":  # the kernels' backward (index_scores') gives "xla"'s gradients
        fx, px = split_grad(make(), mode)
        want = flat(fx(px, x)[1][0])
        for k in want:
            assert np.abs(grads[k] - want[k]).max() <= F32_REORDER * np.abs(want[k]).max(), k
    for k, g in grads.items():
        if k[0] == "indexer":
            assert np.abs(g).max() > 0, f"{k}: no gradient from the loss"
        else:
            assert not g.any(), f"{k}: the indexer loss reached a main parameter"
    # out reaches no indexer parameter (same call, the loss computed too)
    ct = np.random.default_rng(5).standard_normal((B, S, layer.cfg.hidden_size)).astype(np.float32)
    graphdef, p, rest = nnx.split(layer, nnx.Param, ...)

    def out_only(p, x):
        out, _, loss = nnx.merge(graphdef, p, rest)(x, attention_mask=mask, indexer_loss=mode)
        return jnp.sum(out * ct) + 0.0 * loss

    g_out = flat(jax.jit(jax.grad(out_only))(p, x))
    assert all(not g.any() for k, g in g_out.items() if k[0] == "indexer")
    assert all(np.abs(g).max() > 0 for k, g in g_out.items() if k[0] != "indexer")


def _backward_work(step, state) -> set[str]:
    """What of the indexer's backward the program of ``step(state)`` runs: the
    ``index_scores`` backward kernels it launches (``pallas_call`` names, any depth) and
    ``"index_project"`` when a transposed op runs under that scope (its einsums'
    transposes, at the top level of the program)."""
    found = set()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                name = str(e.params.get("name_and_src_info", e.params.get("name"))).split(" ")[0]
                if name.startswith("index_scores_backward"):
                    found.add(name)
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(step)(state).jaxpr)
    if "transpose(jvp(index_project))" in jax.jit(step).lower(state).as_text(debug_info=True):
        found.add("index_project")
    return found


def test_frozen_indexer_runs_no_indexer_backward():
    layer = make(implementation="pallas_interpret")  # the scores' backward is a kernel there
    x, mask = batch()
    ct = jnp.asarray(np.random.default_rng(5).standard_normal((B, S, layer.cfg.hidden_size)), jnp.float32)
    graphdef, state = nnx.split(layer)

    def total(layer, x):
        out, _, loss = layer(x, attention_mask=mask, indexer_loss="dense")
        return jnp.sum(out * ct) + loss

    def step(wrt):
        return lambda state: nnx.grad(total, argnums=nnx.DiffState(0, wrt))(nnx.merge(graphdef, state), x)

    assert _backward_work(step(ATTENTION_PARAMS), state) == set()
    assert _backward_work(step(INDEXER_PARAMS), state) == {  # the check can fail
        "index_scores_backward_dq", "index_scores_backward_dk", "index_project"}
    frozen = step(ATTENTION_PARAMS)(state)
    assert set(flat(frozen)) == set(flat(nnx.state(layer, ATTENTION_PARAMS)))


def test_filters_split_the_parameters():
    layer = make()
    ind, att = flat(nnx.state(layer, INDEXER_PARAMS)), flat(nnx.state(layer, ATTENTION_PARAMS))
    every = flat(nnx.state(layer, nnx.Param))
    assert set(ind) | set(att) == set(every) and not set(ind) & set(att)
    assert set(ind) == {k for k in every if k[0] == "indexer"} and ind
    mask = flat(indexer_param_mask(nnx.state(layer, nnx.Param)))
    assert {k for k, v in mask.items() if v} == set(ind)


# ---------------------------------------------------------------------------- placement
@pytest.mark.parametrize("shape,mode", [((2,), "dense"), ((2, 2), "sparse"), ((2, 2), "dense")])
def test_placed_loss_and_gradients_equal_unplaced(shape, mode):
    x, _ = batch()
    f, params = split_grad(make(), mode, INDEXER_PARAMS)
    (_, (loss, _, topk)), (grads, _) = f(params, x)
    layer = make()
    if len(shape) == 1:
        mesh = tp_mesh(2, "auto")
        gd.shard_layer(layer, mesh)
    else:
        mesh = dp_mesh(shape, "explicit")
        gd.shard_layer(layer, mesh, "tp", batch_axis="data")
    fp, pp = split_grad(layer, mode, INDEXER_PARAMS)
    with jax.set_mesh(mesh):
        (_, (loss_p, _, topk_p)), (grads_p, _) = fp(pp, x)
    np.testing.assert_array_equal(np.asarray(topk_p), np.asarray(topk))
    np.testing.assert_allclose(float(loss_p), float(loss), rtol=F32_REORDER, atol=F32_REORDER)
    want, got = flat(grads), flat(grads_p)
    assert want.keys() == got.keys()
    for k in want:
        scale = np.abs(want[k]).max()
        assert np.abs(got[k] - want[k]).max() <= F32_REORDER * scale, k


# ---------------------------------------------------------------------------- memory
def test_dense_loss_memory_is_linear_in_the_context():
    """GLM-5.3-Flash dims, bf16, one row: the compiled gradient (indexer parameters) of the
    dense loss in the warm-up stage (``attention="dense"``), peak temporary bytes per token
    at 16K tokens over 4K."""
    attention = "dense"
    cfg = gd.DsaConfig.glm53_flash()
    layer_idx = next(i for i, t in enumerate(cfg.layer_types) if t == "indexed_attention")
    abstract = nnx.eval_shape(lambda: gd.DsaAttention(cfg, layer_idx, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, INDEXER_PARAMS, ...)

    def loss(params, rest, x):
        return nnx.merge(graphdef, params, rest)(x, attention=attention, indexer_loss="dense")[2]

    step = jax.jit(jax.grad(jax.checkpoint(loss, policy=remat_policy("selection"))))
    per_token = {}
    for tokens in (4096, 16384):
        x = jax.ShapeDtypeStruct((1, tokens, cfg.hidden_size), jnp.bfloat16)
        per_token[tokens] = step.lower(params, rest, x).compile().memory_analysis().temp_size_in_bytes / tokens
    print(attention, per_token)
    assert per_token[16384] <= MEMORY_GROWTH * per_token[4096], per_token


# ---------------------------------------------------------------------------- attention="dense"
@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_dense_attention_equals_masked_dense_mla(implementation):
    layer = make(implementation=implementation)
    x, mask = batch()
    out, topk = layer(x, attention_mask=mask, attention="dense")
    np.testing.assert_allclose(np.asarray(out), oracle(layer, x, mask)["out_dense"], rtol=F32_VS_F64,
                               atol=F32_VS_F64)
    np.testing.assert_array_equal(np.asarray(topk), np.asarray(layer(x, attention_mask=mask)[1]))
    # a cached prefix then a chunk equals the one-shot call
    cache = layer.init_cache(B, S, dtype=jnp.float32)
    o1, t1, cache = layer(x[:, :11], attention_mask=mask[:, :11], cache=cache, attention="dense")
    o2, t2, _ = layer(x[:, 11:], attention_mask=mask[:, 11:], cache=cache, attention="dense")
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), np.asarray(out), rtol=F32_REORDER, atol=F32_REORDER)


# ---------------------------------------------------------------------------- bad input
def test_bad_modes_raise_naming_the_argument():
    layer = make()
    x, mask = batch()
    with pytest.raises(ValueError, match="indexer_loss"):
        layer(x, attention_mask=mask, indexer_loss="kl")
    with pytest.raises(ValueError, match="indexer_loss"):
        layer(x, attention_mask=mask, indexer_loss=True)
    with pytest.raises(ValueError, match="attention"):
        layer(x, attention_mask=mask, attention="full")
    cache = layer.init_cache(B, S)
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError, match="indexer_loss"):
        layer(x, attention_mask=mask, cache=cache, indexer_loss="dense")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache), before)
    paged = layer.init_paged_cache(B, 8, 4)
    with pytest.raises(ValueError, match="attention"):
        layer(x, attention_mask=mask, cache=paged, attention="dense")
    shared = f32_layer(CFGS["KP4"], 2, seed=1, block_q=BLOCK_Q)
    with pytest.raises(ValueError, match="indexer_loss"):
        shared(x, attention_mask=mask, prev_topk=layer(x, attention_mask=mask)[1], indexer_loss="sparse")
    out, topk = shared(x, attention_mask=mask, prev_topk=layer(x, attention_mask=mask)[1], attention="dense")
    assert out.shape == x.shape
