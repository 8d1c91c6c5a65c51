"""The Hugging Face ``glm5_next`` reference, built from a ``DsaConfig`` for parity tests
(torch: imported only by the modules ``conftest.TORCH_MODULES`` names)."""

from __future__ import annotations

import numpy as np
import torch

import glm5_dsa_jax as gd
from helpers import f32_layer


def hf_text_config(cfg: gd.DsaConfig):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    d = cfg.to_hf_dict()
    d.pop("model_type")
    hf = Glm5NextTextConfig(**d)
    hf._attn_implementation = "eager"
    return hf


def hf_attention(cfg: gd.DsaConfig, layer_idx: int, seed: int = 0):
    """An HF ``Glm5NextTextAttention`` in float32 with every parameter random (the HF init
    leaves the pool gate and APE at zero, which would hide pooling bugs)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    torch.manual_seed(seed)
    attn = Glm5NextTextAttention(hf_text_config(cfg), layer_idx).float().eval()
    randomize_(attn, torch.Generator().manual_seed(seed))
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


def hf_forward(attn, x: np.ndarray, mask: np.ndarray, prev_topk=None):
    """Run the HF layer: returns (out [B,S,hidden], topk [B,S,W] or None) as numpy."""
    xt = torch.from_numpy(np.asarray(x, np.float32))
    mt = torch.from_numpy(np.asarray(mask, bool))
    topk = None
    with torch.no_grad():
        if attn.indexer is not None:
            q_resid = attn.q_a_layernorm(attn.q_a_proj(xt))
            topk = attn.indexer(hidden_states=xt, q_resid=q_resid, attention_mask=mt, past_key_values=None)
        pt = None if prev_topk is None else torch.from_numpy(np.asarray(prev_topk, np.int64)).int()
        out = attn(hidden_states=xt, attention_mask=mt, prev_topk_indices=pt)[0]
    return out.numpy(), None if topk is None else topk.numpy()


def hf_attend_on(attn, x, mask, topk):
    """HF's attention restricted to a given top-k (the indexer bypassed)."""
    indexer, attn.indexer = attn.indexer, None
    try:
        return hf_forward(attn, x, mask, prev_topk=topk)[0]
    finally:
        attn.indexer = indexer


def hf_stepped(attn, cfg: gd.DsaConfig, x: np.ndarray, mask: np.ndarray, chunks: list[int]):
    """Run the HF layer chunk by chunk with a ``DynamicCache``; returns (out, topk) numpy,
    concatenated over the chunks (topk rows of different widths are -1 padded)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_text_config(cfg))
    seen = []
    forward = attn.indexer.forward

    def record(*a, **k):
        seen.append(forward(*a, **k))
        return seen[-1]

    attn.indexer.forward = record
    outs, pos = [], 0
    try:
        with torch.no_grad():
            for n in chunks:
                xt = torch.from_numpy(np.asarray(x[:, pos:pos + n], np.float32))
                mt = torch.from_numpy(np.asarray(mask[:, pos:pos + n], bool))
                outs.append(attn(hidden_states=xt, attention_mask=mt, past_key_values=cache)[0].numpy())
                pos += n
    finally:
        del attn.indexer.forward
    return np.concatenate(outs, 1), np.concatenate([t.numpy() for t in seen], 1)
