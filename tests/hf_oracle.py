"""The Hugging Face references, built from a ``DsaConfig`` for parity tests: the attention
classes of ``glm5_next`` (``Glm5NextTextAttention``), ``glm_moe_dsa`` (``GlmMoeDsaAttention``)
and ``deepseek_v32`` (``DeepseekV32Attention``), with random parameters, their models' rotary
embeddings (``hf_rotary``), and the calls that run them as their decoder layers do (torch:
imported only by the modules ``conftest.TORCH_MODULES`` names).

How the three are called (read from their ``*Model.forward`` / decoder layers):

* ``glm5_next`` (NoPE) builds its causal mask inside the attention from a ``[B, S]`` bool
  padding mask; no positions.
* ``glm_moe_dsa`` / ``deepseek_v32`` take ``position_embeddings = (cos, sin)`` from the
  model's rotary embedding at ``position_ids`` (HF's default: ``arange(past, past + S)``,
  padding included, so a left-padded row's first real token is at the pad count), and a
  4-D ``[B, 1, S, T]`` mask; the eager path *adds* it, so it is built additive here (0 or
  the float32 minimum: causal and key not padding), as ``create_causal_mask`` builds it.
  Their indexer is called ``(hidden_states, q_resid, position_embeddings, mask[:, 0],
  position_ids, past_key_values=...)``. ``glm_moe_dsa``'s attention returns
  ``(out, weights, topk)`` and takes ``prev_topk_indices`` on a shared layer;
  ``deepseek_v32``'s returns ``(out, weights)`` and always runs its indexer.

HF's own selection: every run of an HF indexer by ``hf_forward`` / ``hf_stepped`` records the
scores HF ranks (the tensor its ``topk`` is called on) and, for ``glm5_next``, the tokens of
each pool (``get_pooled_states``); ``hf_selection(attn)`` returns those of the last run
(``HfSelection``), so a selection is judged by HF's scores, not by the layer under test.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

import glm5_dsa_jax as gd
from helpers import f32_layer

_ROTARY = {}  # id(attn) -> its model's rotary embedding (kept off the module's state)
_SELECTION = {}  # id(attn) -> HfSelection of its indexer's last run (hf_forward / hf_stepped)


class HfSelection(NamedTuple):
    """What HF's indexer ranked, per query row: ``scores [B, S, P]`` float32 over its
    candidates (``-inf``: not a candidate of that query, HF's masked entries), ``pools [B, S,
    P, KP]`` the token ids of each candidate (a token for ``index_kpool == 1``; ``-1``
    padding), its top-k ``topk [B, S, W]`` token ids, and ``tail [B, S, KP - 1]`` the
    tail tokens it appended after its pools (``-1``: none; with holes in the mask HF's tail
    may repeat tokens of a chosen pool)."""

    scores: np.ndarray
    pools: np.ndarray
    topk: np.ndarray
    tail: np.ndarray


def hf_selection(attn) -> HfSelection:
    """HF's own selection of the last ``hf_forward`` / ``hf_stepped`` that ran ``attn``'s
    indexer (module doc)."""
    return _SELECTION[id(attn)]


@contextlib.contextmanager
def _recording(attn):
    """Record each run of ``attn.indexer``: ``{"scores", "pools", "topk"}`` torch, in a list."""
    idx, calls = attn.indexer, []
    forward, pooled = idx.forward, getattr(idx, "get_pooled_states", None)

    def run(*a, **k):
        rec, topk = {}, torch.Tensor.topk

        def ranked(t, *ta, **tk):  # the first topk of an indexer run ranks its candidates
            rec.setdefault("scores", t.detach().float().clone())
            return topk(t, *ta, **tk)

        def pools(*ga, **gk):
            out = pooled(*ga, **gk)
            rec["pools"] = out[1].detach().clone()
            return out

        torch.Tensor.topk = ranked
        if pooled is not None:
            idx.get_pooled_states = pools
        try:
            out = forward(*a, **k)
        finally:
            torch.Tensor.topk = topk
            if pooled is not None:
                del idx.get_pooled_states
        rec["topk"] = out
        # The layout HF returns: its chosen pools' tokens, then (glm5_next) the tail.
        kp = getattr(idx, "index_kpool", 1)
        rec["pools_width"] = min(idx.index_topk // kp, rec["scores"].shape[-1]) * kp
        rec["tail_width"] = kp - 1 if getattr(idx, "index_kpool_always_select_tail", False) else 0
        calls.append(rec)
        return out

    idx.forward = run
    try:
        yield calls
    finally:
        del idx.forward


def _as_selection(rec) -> HfSelection:
    """One indexer run's record as numpy: HF's masked scores (its dtype's minimum, or that
    added to a score) become ``-inf``; a RoPE model's candidates are its tokens."""
    scores = rec["scores"].numpy()
    scores = np.where(scores > np.finfo(np.float32).min / 2, scores, -np.inf).astype(np.float32)
    b, s, p = scores.shape
    if "pools" in rec:
        pools = np.broadcast_to(rec["pools"].numpy()[:, None], (b, s) + tuple(rec["pools"].shape[1:]))
    else:
        pools = np.broadcast_to(np.arange(p)[None, None, :, None], (b, s, p, 1))
    topk = rec["topk"].numpy()
    tail = topk[..., rec["pools_width"]:rec["pools_width"] + rec["tail_width"]]
    return HfSelection(scores, np.asarray(pools, np.int64), topk, tail)


def _record_selection(attn, calls, first: bool = True) -> None:
    """Keep the first (or every, chunk after chunk: ``first=False``) recorded run as
    ``attn``'s selection, candidates padded to the widest run."""
    if not calls:
        return
    sels = [_as_selection(c) for c in (calls[:1] if first else calls)]
    p = max(x.scores.shape[2] for x in sels)
    w = max(x.topk.shape[2] for x in sels)
    kp = sels[0].pools.shape[3]
    tw = max(x.tail.shape[2] for x in sels)
    _SELECTION[id(attn)] = HfSelection(
        np.concatenate([np.pad(x.scores, ((0, 0), (0, 0), (0, p - x.scores.shape[2])),
                               constant_values=-np.inf) for x in sels], 1),
        np.concatenate([np.pad(x.pools, ((0, 0), (0, 0), (0, p - x.pools.shape[2]), (0, 0)),
                               constant_values=-1) for x in sels], 1),
        np.concatenate([np.pad(x.topk, ((0, 0), (0, 0), (0, w - x.topk.shape[2])),
                               constant_values=-1) for x in sels], 1),
        np.concatenate([np.pad(x.tail, ((0, 0), (0, 0), (0, tw - x.tail.shape[2])),
                               constant_values=-1) for x in sels], 1))
    assert _SELECTION[id(attn)].pools.shape[3] == kp


def _classes(model_type: str):
    """(config class, attention class, rotary class or None) of a model type."""
    if model_type == "glm5_next":
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

        return Glm5NextTextConfig, Glm5NextTextAttention, None
    if model_type == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

        return m.GlmMoeDsaConfig, m.GlmMoeDsaAttention, m.GlmMoeDsaRotaryEmbedding
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    return m.DeepseekV32Config, m.DeepseekV32Attention, m.DeepseekV32RotaryEmbedding


def hf_config(cfg: gd.DsaConfig):
    """The HF (text) config of ``cfg``'s model type, from ``cfg.to_hf_dict()``, eager attention."""
    d = cfg.to_hf_dict()
    d.pop("model_type")
    hf = _classes(cfg.model_type)[0](**d)
    hf._attn_implementation = "eager"
    return hf


def hf_rotary(cfg: gd.DsaConfig):
    """The rotary embedding of ``cfg``'s (RoPE) model type, built from ``hf_config(cfg)``."""
    return _classes(cfg.model_type)[2](hf_config(cfg))


def hf_attention(cfg: gd.DsaConfig, layer_idx: int, seed: int = 0):
    """The HF attention of ``cfg``'s model type in float32 with every parameter random (the
    HF init leaves the pool gate and APE at zero, which would hide pooling bugs)."""
    torch.manual_seed(seed)
    _, attn_cls, rotary_cls = _classes(cfg.model_type)
    hf = hf_config(cfg)
    attn = attn_cls(hf, layer_idx).float().eval()
    randomize_(attn, torch.Generator().manual_seed(seed))
    if rotary_cls is not None:
        _ROTARY[id(attn)] = rotary_cls(hf)
    return attn


def layer_from_hf(cfg: gd.DsaConfig, layer_idx: int, attn) -> gd.DsaAttention:
    """Our float32 layer ``layer_idx`` holding the HF layer ``attn``'s weights: the pair a
    parity test runs on the same input."""
    layer = f32_layer(cfg, layer_idx)
    layer.load_hf_weights(state_dict_np(attn))
    return layer


def randomize_(module, generator) -> None:
    """Every parameter of ``module`` random, in place: norms ~1, vectors ~0.2, matrices
    scaled by fan-in."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)


def state_dict_np(attn) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in attn.state_dict().items()}


def _roped(attn) -> bool:
    return id(attn) in _ROTARY


def hf_position_embeddings(attn, position_ids: np.ndarray):
    """``(cos, sin)`` of ``attn``'s model at ``position_ids`` ``[B, S]`` (float32 torch)."""
    with torch.no_grad():
        return _ROTARY[id(attn)](torch.zeros(1, dtype=torch.float32), torch.from_numpy(np.array(position_ids)))


def additive_mask(key_valid: np.ndarray, q_start: int, n_q: int) -> torch.Tensor:
    """``[B, 1, n_q, T]`` float32: 0 where key ``t <= q_start + i`` is visible and not padding,
    the float32 minimum elsewhere (``create_causal_mask``'s eager mask)."""
    kv = np.asarray(key_valid, bool)
    t = np.arange(kv.shape[1])
    ok = (t[None, :] <= q_start + np.arange(n_q)[:, None])[None] & kv[:, None, :]
    return torch.from_numpy(np.where(ok, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None])


def _roped_call(attn, xt, mask4, pos, cache=None, prev_topk=None):
    """One call of a RoPE model's attention: (out, topk) torch."""
    pe = hf_position_embeddings(attn, pos)
    kw = dict(hidden_states=xt, position_embeddings=pe, attention_mask=mask4, past_key_values=cache,
              position_ids=torch.from_numpy(np.array(pos)))
    out = attn(**kw) if attn.indexer is not None else attn(**kw, prev_topk_indices=prev_topk)
    return out[0], (out[2] if len(out) > 2 else None)


def hf_forward(attn, x: np.ndarray, mask: np.ndarray, prev_topk=None, position_ids=None):
    """Run the HF layer on a whole sequence: returns (out [B,S,hidden], topk [B,S,W] or
    None) as numpy. ``mask`` is the ``[B, S]`` padding mask; ``position_ids`` (RoPE models)
    default to HF's ``arange(S)`` per row."""
    xt = torch.from_numpy(np.asarray(x, np.float32))
    if prev_topk is not None and _roped(attn):
        prev_topk = _no_empty_ids(prev_topk)
    pt = None if prev_topk is None else torch.from_numpy(np.asarray(prev_topk, np.int64)).int()
    if attn.indexer is None or pt is not None:
        return _hf_forward(attn, xt, mask, pt, position_ids)
    with _recording(attn) as calls:
        out = _hf_forward(attn, xt, mask, pt, position_ids)
    _record_selection(attn, calls)
    return out


def _hf_forward(attn, xt, mask, pt, position_ids):
    topk = None
    with torch.no_grad():
        if not _roped(attn):
            mt = torch.from_numpy(np.asarray(mask, bool))
            if attn.indexer is not None:
                q_resid = attn.q_a_layernorm(attn.q_a_proj(xt))
                topk = attn.indexer(hidden_states=xt, q_resid=q_resid, attention_mask=mt, past_key_values=None)
            out = attn(hidden_states=xt, attention_mask=mt, prev_topk_indices=pt)[0]
            return out.numpy(), None if topk is None else topk.numpy()
        b, s = np.asarray(mask).shape
        pos = np.broadcast_to(np.arange(s), (b, s)) if position_ids is None else np.asarray(position_ids)
        mask4 = additive_mask(mask, 0, s)
        if attn.indexer is not None and pt is None:
            q_resid = attn.q_a_layernorm(attn.q_a_proj(xt))
            topk = attn.indexer(xt, q_resid, hf_position_embeddings(attn, pos), mask4[:, 0],
                                torch.from_numpy(pos.copy()), past_key_values=None)
        if pt is not None and attn.indexer is not None:  # a full layer ignores prev_topk
            return _with_topk(attn, lambda: _roped_call(attn, xt, mask4, pos)[0].numpy(), pt), None
        out, _ = _roped_call(attn, xt, mask4, pos, prev_topk=pt)
    return out.numpy(), None if topk is None else topk.numpy()


def _with_topk(attn, run, topk):
    """``run()`` with ``attn``'s indexer answering ``topk`` (a model with no top-k input)."""
    attn.indexer.forward = lambda *a, **k: topk
    try:
        return run()
    finally:
        del attn.indexer.forward


def _no_empty_ids(topk):
    """Our ``-1`` (no token) as an id HF's ``scatter`` accepts without changing the set:
    the row's largest id (a repeat), or the last key for a row with none (such rows, padding
    queries, are not compared)."""
    topk = np.asarray(topk)
    first = np.where((topk >= 0).any(-1), topk.max(-1), -1)
    first = np.where(first >= 0, first, topk.shape[1] - 1)
    return np.where(topk >= 0, topk, first[..., None])


def hf_attend_on(attn, x, mask, topk, position_ids=None):
    """HF's attention restricted to a given top-k (the indexer bypassed)."""
    if _roped(attn):
        return hf_forward(attn, x, mask, prev_topk=topk, position_ids=position_ids)[0]
    indexer, attn.indexer = attn.indexer, None
    try:
        return hf_forward(attn, x, mask, prev_topk=topk)[0]
    finally:
        attn.indexer = indexer


def hf_stepped(attn, cfg: gd.DsaConfig, x: np.ndarray, mask: np.ndarray, chunks: list[int]):
    """Run the HF layer chunk by chunk with a ``DynamicCache`` (positions ``arange`` over the
    whole timeline, as HF's model numbers them); returns (out, topk) numpy, concatenated over
    the chunks (topk rows of different widths are -1 padded); ``hf_selection(attn)`` holds
    the scores of every chunk."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_config(cfg))
    outs, pos = [], 0
    with _recording(attn) as calls, torch.no_grad():
        for n in chunks:
            xt = torch.from_numpy(np.asarray(x[:, pos:pos + n], np.float32))
            if _roped(attn):
                p = np.broadcast_to(np.arange(pos, pos + n), (x.shape[0], n)).copy()
                out, _ = _roped_call(attn, xt, additive_mask(mask[:, :pos + n], pos, n), p, cache=cache)
            else:
                mt = torch.from_numpy(np.asarray(mask[:, pos:pos + n], bool))
                out = attn(hidden_states=xt, attention_mask=mt, past_key_values=cache)[0]
            outs.append(out.numpy())
            pos += n
    _record_selection(attn, calls, first=False)
    return np.concatenate(outs, 1), hf_selection(attn).topk
