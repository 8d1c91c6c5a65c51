"""fp8 caches: latent rows and pooled indexer keys in e4m3 (``float8_e4m3fn``) with float32
scales (one per row; a RoPE latent row's default ``"group"`` layout: one per 128 columns of
``c`` and one for ``k_rot``), or pooled keys in int8 with a scale per 32 columns
(``index_keys="int8"``), quantised once where a row is written and dequantised inside the
kernels that read it.

Invariants:

* **What is quantised.** A latent row (``kv_lora_rank`` values, plus ``k_rot`` with RoPE: the
  whole ``kv_cache_dim``-wide row shares one scale) and a pooled key (``index_head_dim``
  values) are each one *row*: ``scale = amax(|row|) / 448`` (448 is e4m3's largest finite
  value), ``q = row / scale`` clipped to ``[-448, 448]`` and cast to e4m3 (round to
  nearest; e4m3fn has no infinity and turns an overflow into NaN, hence the clip). A row
  of zeros (a padding token, an empty slot) has ``amax = 0`` and gets ``scale = 1``, so it
  dequantises to exact zeros, never ``0 / 0``; a non-finite ``amax`` also gets 1.
* **Error.** ``dequantize_rows(*quantize_rows(x)) = q * scale`` differs from ``x`` by at most
  half an e4m3 ulp of ``x / scale`` times ``scale`` (plus float32 rounding): ``<= 2**-4 * |x|``
  for the normal range (3 mantissa bits), and ``<= 2**-10 * scale = 2**-10 * amax / 448``
  where ``x / scale`` is subnormal (``< 2**-6``). So every element is within ``2**-4`` of the
  row's ``amax``. ``tests/test_fp8_cache.py`` checks the exact half-ulp bound.
* **Why one scale per NoPE row, not per 128-wide group.** A row of 512 latent values with one
  scale costs 516 bytes; four 128-groups would cost 528, and with the 33 bytes a token of
  pooled keys costs (32 + 4 / 4 scale) and the validity byte the per-token total (562)
  would break the 560-byte per-token budget of an fp8 cache (``tests/test_fp8_cache.py``
  checks it; ``glm5_dsa_jax.cache.contiguous`` cites this argument). The latent is ``kv_a_layernorm``'s output,
  whose channels share one scale by construction, so a row scale loses little.
* **Latent layouts** (issue 26, deliverable 4; ``LatentFormat``). ``"row"`` is the layout
  above: one scale for the whole ``[c, k_rot]`` row. On a RoPE model ``k_rot`` then sets the
  scale: hidden states x1e6 round 99 % of the ``c`` entries to zero. ``"group"`` gives the
  latent ``c`` one scale per ``group`` columns (128, vLLM's group) and ``k_rot`` a scale of
  its own: ``n_groups = value_width / group + (rot_width > 0)`` float32 scales a row, shaped
  ``[..., G]``. A NoPE model (GLM-5.3-Flash) gets ``group = value_width``: G = 1, bit for
  bit the ``"row"`` layout (four groups would cost 12 bytes a token and break its 560-byte
  budget, see below). Every group obeys the row's error bound with its own amax.
  Bytes a latent row (``LatentFormat.bytes_per_token``): DeepSeek-V3.2 / GLM-5 (C 512,
  R 64) ``"row"`` 580, ``"group"`` 596 (vLLM's ``fp8_ds_mla``, with ``k_rot`` in bf16: 656);
  GLM-5.3-Flash (C 512, R 0) 516 in both layouts.
* **Hadamard rotation of the indexer** (``hadamard``). ``x @ H / sqrt(D)`` with ``H`` the
  Sylvester-Hadamard matrix is a rotation (``H H^T = D I``), so ``(q R) . (k R) = q . k``
  in exact arithmetic (float32 reorders: ``max|s_rot - s| / max|s|`` below ``1e-6``,
  ``tests/test_fp8_groups.py``); it spreads a channel's outliers over all ``D`` before the
  pooled key's one scale is taken (DeepSeek's ``rotate_activation``; its effect on recall
  is a measurement, not a theorem). It mixes channels, and the gate's softmax
  is per channel, so it applies *after* pooling (to the pooled key and to the query), not
  to the stage. A cache's static ``rotate_index`` says that its ``store_pools`` stores
  rotated pooled keys (``rotate_index_rows``; ``cache.pooled`` then holds them rotated) and
  that the layer rotates its indexer queries once after ``DsaIndexer.project``
  (``index_queries``). Off by default. Measured with ``glm5-dsa accuracy``, it does not
  raise the recall of e4m3 keys (GLM-5.3-Flash, 32K: 0.958 rotated against 0.969), whose
  error is relative to each value; it does raise int8 keys' (0.985 -> 0.992;
  ``docs/fp8.md``).
* **int8 pooled keys** (``IndexFormat``, ``index_keys="int8"``; issue 26's recall goal).
  Each 32-column group of a pooled key gets ``scale = amax / 127`` and ``q =
  round(x / scale)`` in ``[-127, 127]``: every value within ``amax / 254`` of the original,
  a uniform step where e4m3's is relative (up to 6 % of a value): the fp8 indexer's misses
  are near-ties that e4m3's relative error swaps. An all-zero group gets 1 (exact zeros); a
  non-finite group gets NaN, so the key scores NaN and is never a candidate, as a NaN key of
  a float cache (``quantize_index`` writes 0 for its values). Groups, not one scale a key:
  measured by emulation on a filled 32K cache, one scale a key reached recall 0.9896 and
  32-column groups 0.9912 (GLM-5.3-Flash, seed 0). Bytes: ``D + 4 * D / 32`` = 144 a key
  at D = 128 (e4m3: 132); GLM-5.3-Flash 552 a token, within its 560. A group's scale does
  not commute with the sum over the key's columns, so the kernels dequantise int8 keys to
  float32 before the dot (``pallas_kernels._dtypes.INT8``) and dot in float32, with the
  rotated queries left float32 (``index_queries``). The stored values are ``int8``; the
  scales ``[..., G]``; a cache's static ``index_format`` says which (``pooled_dtype``).
* **Quantise once.** Only the caches' writes (``write_latent`` and ``store_pools`` of
  either cache, and ``replace(latent=, pooled=)``) call ``quantize_latent_rows`` /
  ``quantize_index``;
  the stage of the incomplete pool stays in the compute dtype (it is pooled later).
* **Dequantise in the kernels.** ``index_scores`` / ``index_scores_paged`` take
  ``pooled_scale`` and multiply each pool's head-summed score by it (``score = scale_p *
  sum_h w_h relu(q_h . k8_p / sqrt(D))``: ``scale_p > 0`` commutes with the ReLU, so this
  is the score of the dequantised key, with one multiply per (query, pool); int8 keys:
  their group scales before the dot, see above); ``sparse_mla``
  takes ``latent_scale`` (see its module doc). The ``"xla"`` references do the same
  arithmetic in the same order, so the top-k of ``"xla"`` and Pallas agree bit for bit.
* **Which kernels can read e4m3.** Triton converts e4m3 only on compute capability 8.9 and
  newer (Ada, Hopper): ``check_readable`` refuses an fp8 cache for ``implementation=
  "pallas"`` on an older GPU (an A100 is 8.0), naming the capability and the dtype. The
  ``"xla"`` and ``"pallas_interpret"`` paths read e4m3 anywhere. The Mosaic GPU kernels
  read 16-bit rows only: under ``"mosaic"`` the scoring and attention steps of an fp8
  cache run the Triton kernels (sm_90+ converts e4m3), as float32 operands do.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FP8", "E4M3_MAX", "INT8", "INT8_MAX", "INDEX_KEY_FORMATS", "INDEX_GROUP", "IndexFormat",
           "index_format", "check_index_keys", "quantize_index", "dequantize_index", "index_queries", "is_fp8", "quantize_rows", "dequantize_rows", "LATENT_LAYOUTS",
           "LatentFormat", "latent_format", "check_latent_layout", "quantize_latent", "quantize_latent_rows",
           "dequantize_latent", "hadamard", "rotate_index_rows", "check_rotate_index",
           "check_readable", "check_cache_readable"]

#: The fp8 cache dtype.
FP8 = jnp.dtype(jnp.float8_e4m3fn)
#: e4m3fn's largest finite value: a row's ``amax`` maps to it.
E4M3_MAX = 448.0
#: The latent row layouts (``LatentFormat.layout``): one scale a row, or one a group.
LATENT_LAYOUTS = ("row", "group")
#: Columns per scale of the ``"group"`` layout on a RoPE model (vLLM's fp8 MLA group).
LATENT_GROUP = 128
#: Compute capability from which Triton converts e4m3 (sm_89: Ada; Hopper is 9.0).
MIN_CAPABILITY = (8, 9)


#: The int8 pooled-key dtype (``index_keys="int8"``) and its largest magnitude used.
INT8 = jnp.dtype(jnp.int8)
INT8_MAX = 127.0
#: The pooled-key formats of an fp8 cache (``IndexFormat.keys``): e4m3 with one scale a key,
#: or int8 with one scale per ``INDEX_GROUP`` columns (module doc: why).
INDEX_KEY_FORMATS = ("e4m3", "int8")
#: Columns per scale of the ``"int8"`` pooled keys.
INDEX_GROUP = 32


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is the fp8 cache dtype (``float8_e4m3fn``)."""
    return dtype is not None and jnp.dtype(dtype) == FP8


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., width]`` -> ``(q [..., width] float8_e4m3fn, scale [...] float32)`` with one scale
    per row (the last axis); see the module doc."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / E4M3_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(xf / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(FP8)
    return q, scale


def dequantize_rows(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q [..., width]`` (e4m3) times its row's ``scale [...]``, in float32."""
    return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


@dataclasses.dataclass(frozen=True)
class LatentFormat:
    """How an fp8 latent row ``[c (value_width), k_rot (rot_width)]`` is scaled (module doc).

    ``layout="row"``: one scale for the whole row (``group`` is ignored and ``n_groups`` is
    1). ``layout="group"``: one scale per ``group`` columns of ``c`` (``value_width %
    group == 0``) and, when ``rot_width > 0``, one for ``k_rot``. Static (hashable)."""

    value_width: int
    rot_width: int = 0
    layout: str = "group"
    group: int = LATENT_GROUP

    def __post_init__(self):
        if self.layout not in LATENT_LAYOUTS:
            raise ValueError(f"LatentFormat.layout must be one of {LATENT_LAYOUTS}, got {self.layout!r}")
        if self.value_width < 1 or self.rot_width < 0:
            raise ValueError(f"LatentFormat needs value_width >= 1 and rot_width >= 0, got value_width "
                             f"{self.value_width}, rot_width {self.rot_width}")
        if self.layout == "group" and (self.group < 1 or self.value_width % self.group):
            raise ValueError(f"LatentFormat.group must divide value_width {self.value_width} (layout "
                             f"'group'), got group {self.group}")

    @property
    def width(self) -> int:
        """Columns of a row: ``value_width + rot_width``."""
        return self.value_width + self.rot_width

    @property
    def n_groups(self) -> int:
        """Scales a row (the last axis of ``latent_scale``)."""
        if self.layout == "row":
            return 1
        return self.value_width // self.group + (self.rot_width > 0)

    @property
    def group_widths(self) -> tuple[int, ...]:
        """Columns of each group, in row order (they sum to ``width``)."""
        if self.layout == "row":
            return (self.width,)
        return (self.group,) * (self.value_width // self.group) + ((self.rot_width,) if self.rot_width else ())

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The trailing shape of a cache's ``latent_scale`` (``quantize_latent_rows``): ``()``
        for one scale a row, ``(n_groups,)`` for more."""
        return () if self.n_groups == 1 else (self.n_groups,)

    def column_groups(self) -> np.ndarray:
        """``[width]`` int32: the group of each column."""
        return np.repeat(np.arange(self.n_groups, dtype=np.int32), self.group_widths)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one fp8 latent row with its scales: ``width + 4 * n_groups``."""
        return self.width + 4 * self.n_groups


def latent_format(value_width: int, rot_width: int = 0, layout: str = "group") -> LatentFormat:
    """The fp8 latent format of a model: ``"group"`` gives 128-column groups plus a ``k_rot``
    group on a RoPE model (``rot_width > 0``) and one group of ``value_width`` on a NoPE
    model (G = 1, the ``"row"`` layout's bits; module doc); ``"row"``: one scale a row. A
    ``value_width`` that 128 does not divide (the tiny test presets) is one latent group."""
    if layout == "group" and (rot_width == 0 or value_width % LATENT_GROUP):
        return LatentFormat(value_width, rot_width, "group", value_width)
    return LatentFormat(value_width, rot_width, layout)


def check_latent_layout(layout) -> str:
    """``layout`` if it is one of ``LATENT_LAYOUTS``, else ``ValueError`` naming
    ``latent_layout`` (the caches' static option)."""
    if layout not in LATENT_LAYOUTS:
        raise ValueError(f"latent_layout must be one of {LATENT_LAYOUTS}, got {layout!r}")
    return layout


def _check_width(x, fmt: LatentFormat) -> None:
    if x.shape[-1] != fmt.width:
        raise ValueError(f"latent rows must be {fmt.width} wide (value_width {fmt.value_width} + rot_width "
                         f"{fmt.rot_width}), got {x.shape[-1]}")


def quantize_latent(x: jax.Array, fmt: LatentFormat) -> tuple[jax.Array, jax.Array]:
    """``x [..., width]`` -> ``(q [..., width] e4m3, scale [..., n_groups] float32)``: each group
    of ``fmt`` quantised as ``quantize_rows`` quantises a row (G = 1: ``quantize_rows``'s bits)."""
    _check_width(x, fmt)
    if fmt.n_groups == 1:
        q, scale = quantize_rows(x)
        return q, scale[..., None]
    parts = [quantize_rows(part) for part in jnp.split(x, np.cumsum(fmt.group_widths)[:-1].tolist(), axis=-1)]
    return (jnp.concatenate([q for q, _ in parts], axis=-1),
            jnp.stack([s for _, s in parts], axis=-1))


def quantize_latent_rows(x: jax.Array, fmt: LatentFormat) -> tuple[jax.Array, jax.Array]:
    """The caches' quantising write of latent rows ``x [..., width]``: ``quantize_latent``,
    with one group's scale as the row scale ``[...]`` (the shape, and the bits, of an fp8
    cache before group scales: ``quantize_rows``) and ``G > 1`` groups' as ``[..., G]``."""
    q, scale = quantize_latent(x, fmt)
    return q, scale[..., 0] if fmt.n_groups == 1 else scale


def dequantize_latent(q: jax.Array, scale: jax.Array, fmt: LatentFormat) -> jax.Array:
    """``q [..., width]`` (e4m3) times its groups' ``scale [..., n_groups]``, in float32."""
    _check_width(q, fmt)
    if scale.shape[-1] != fmt.n_groups:
        raise ValueError(f"latent_scale must end in n_groups = {fmt.n_groups} ({fmt.layout!r} layout), got "
                         f"shape {tuple(scale.shape)}")
    cols = jnp.asarray(fmt.column_groups())
    return q.astype(jnp.float32) * jnp.take(scale.astype(jnp.float32), cols, axis=-1)


@dataclasses.dataclass(frozen=True)
class IndexFormat:
    """How an fp8 cache stores a pooled indexer key of ``width`` (``index_head_dim``) values.

    ``keys="e4m3"``: e4m3 values and one float32 scale a key (``quantize_rows``; the scale
    multiplies the head-summed score, after the dot). ``keys="int8"``: int8 values and one
    float32 scale per ``group`` columns (``amax / 127`` each), dequantised to float32 before
    the dot. Static (hashable)."""

    width: int
    keys: str = "e4m3"
    group: int = INDEX_GROUP

    def __post_init__(self):
        if self.keys not in INDEX_KEY_FORMATS:
            raise ValueError(f"index_keys must be one of {INDEX_KEY_FORMATS}, got {self.keys!r}")
        if self.keys == "int8" and (self.group < 1 or self.width % self.group):
            raise ValueError(f"int8 pooled keys need a group dividing index_head_dim {self.width}, "
                             f"got group {self.group}")

    @property
    def dtype(self) -> jnp.dtype:
        """The stored values' dtype: ``float8_e4m3fn`` or ``int8``."""
        return FP8 if self.keys == "e4m3" else INT8

    @property
    def n_groups(self) -> int:
        """Scales a key: 1 for e4m3, ``width / group`` for int8."""
        return 1 if self.keys == "e4m3" else self.width // self.group

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The trailing shape of a cache's ``pooled_scale``: ``()`` (e4m3), ``(G,)`` (int8)."""
        return () if self.keys == "e4m3" else (self.n_groups,)

    @property
    def bytes_per_pool(self) -> int:
        """Bytes of one stored pooled key with its scales: ``width + 4 * n_groups``."""
        return self.width + 4 * self.n_groups


def index_format(width: int, keys: str = "e4m3") -> IndexFormat:
    """The pooled-key format of an fp8 cache: int8 keys take ``INDEX_GROUP``-column groups
    (one group of ``width`` when 32 does not divide it: the tiny test presets)."""
    check_index_keys(keys)
    return IndexFormat(width, keys, INDEX_GROUP if width % INDEX_GROUP == 0 else width)


def check_index_keys(keys) -> str:
    """``keys`` if it is one of ``INDEX_KEY_FORMATS``, else ``ValueError`` naming
    ``index_keys`` (the caches' static option)."""
    if keys not in INDEX_KEY_FORMATS:
        raise ValueError(f"index_keys must be one of {INDEX_KEY_FORMATS}, got {keys!r}")
    return keys


def quantize_index(x: jax.Array, fmt: IndexFormat) -> tuple[jax.Array, jax.Array]:
    """Pooled keys ``x [..., width]`` -> ``(values, scale)`` in ``fmt``: e4m3,
    ``quantize_rows`` (``scale [...]``); int8, ``round(x / s)`` with ``s = amax / 127`` per
    group (``scale [..., G]``; an all-zero group gets 1, a non-finite one NaN, so the key's
    scores are NaN and it is never a candidate, as a NaN float key)."""
    if fmt.keys == "e4m3":
        return quantize_rows(x)
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], fmt.n_groups, fmt.group)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(jnp.isfinite(amax), jnp.where(amax > 0, amax / INT8_MAX, 1.0), jnp.nan)
    q = jnp.where(jnp.isfinite(xf), jnp.round(xf / jnp.where(jnp.isfinite(scale), scale, 1.0)[..., None]), 0.0)
    q = jnp.clip(q, -INT8_MAX, INT8_MAX).astype(INT8).reshape(x.shape)
    return q, scale.astype(jnp.float32)


def dequantize_index(q: jax.Array, scale: jax.Array) -> jax.Array:
    """Stored pooled keys ``q [..., D]`` times their scales, in float32: ``scale [...]`` (one
    a key) or ``[..., G]`` (one per ``D / G`` columns)."""
    qf = q.astype(jnp.float32)
    s = scale.astype(jnp.float32)
    if s.ndim == q.ndim - 1:
        return qf * s[..., None]
    g = s.shape[-1]
    return (qf.reshape(*q.shape[:-1], g, q.shape[-1] // g) * s[..., None]).reshape(q.shape)


@functools.lru_cache(maxsize=None)
def _hadamard_matrix(d: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(d))


def hadamard(x: jax.Array) -> jax.Array:
    """``x [..., D]`` rotated by the normalised Sylvester-Hadamard matrix ``H / sqrt(D)`` (an
    orthogonal, symmetric matrix), computed in float32 and returned in float32; ``D`` must be a
    power of two (else ``ValueError``). Module doc: why, and where it applies."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two last axis (index_head_dim), got {d}")
    return jnp.matmul(x.astype(jnp.float32), jnp.asarray(_hadamard_matrix(d)),
                      precision=jax.lax.Precision.HIGHEST)


def rotate_index_rows(x: jax.Array, rotate: bool, keep_float32: bool = False) -> jax.Array:
    """``x [..., D]`` (pooled indexer keys, or indexer queries) ``hadamard``-rotated and cast
    back to ``x``'s dtype (``keep_float32``: left in float32) when ``rotate`` (a cache's
    static ``rotate_index``), else ``x`` itself: the caches' ``store_pools`` rotate the
    pooled keys they store, the layer its indexer queries, so every score is the unrotated
    one up to rounding (module doc). The queries of int8 keys stay float32: their dot is in
    float32 anyway, and a rounded rotated query would add an error the unrotated one has not."""
    if not rotate:
        return x
    return hadamard(x) if keep_float32 else hadamard(x).astype(x.dtype)


def index_queries(qi: jax.Array, rotate: bool, fmt: "IndexFormat | None") -> jax.Array:
    """The indexer queries ``qi [..., D]`` as a cache of static ``rotate_index = rotate`` and
    pooled-key format ``fmt`` scores them: ``rotate_index_rows``, left in float32 for int8
    keys (their dot is in float32)."""
    return rotate_index_rows(qi, rotate, keep_float32=fmt is not None and fmt.keys == "int8")


def check_rotate_index(index_head_dim: int, rotate_index) -> bool:
    """A cache's ``rotate_index`` (off by default, module doc): a bool; True needs a
    power-of-two ``index_head_dim``, else ``ValueError`` naming both."""
    pow2 = index_head_dim >= 1 and not index_head_dim & (index_head_dim - 1)
    if not isinstance(rotate_index, bool):
        raise ValueError(f"rotate_index must be a bool or None, got {rotate_index!r}")
    if rotate_index and not pow2:
        raise ValueError(f"rotate_index=True needs a power-of-two index_head_dim (a Hadamard "
                         f"rotation), got index_head_dim={index_head_dim}")
    return rotate_index


def _capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def check_readable(dtype, implementation: str, devices) -> None:
    """Raise ``ValueError`` when a cache of ``dtype`` is fp8, ``implementation`` is
    ``"pallas"`` or ``"mosaic"`` (whose wrappers run the Triton kernels on fp8 rows) and one
    of ``devices`` is a GPU of compute capability below 8.9 (Triton cannot convert e4m3
    there)."""
    if not is_fp8(dtype) or implementation not in ("pallas", "mosaic"):
        return
    for d in devices:
        cc = _capability(d)
        if getattr(d, "platform", None) in ("gpu", "cuda") and cc is not None and cc < MIN_CAPABILITY:
            raise ValueError(
                f"an fp8 cache (dtype {FP8.name}) cannot be read by implementation={implementation!r} on "
                f"{d}: its compute capability is {cc[0]}.{cc[1]}, and Triton converts e4m3 only "
                f"from {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper); use a bfloat16 "
                "cache or implementation='xla'")


def check_cache_readable(cache, implementation: str) -> None:
    """``check_readable`` for ``cache`` (a ``DsaCache`` or ``PagedCache``) on the devices that
    hold it (inside a trace: the default backend's devices)."""
    check_readable(cache.dtype, implementation, _devices_of(cache.latent_store))


def _devices_of(leaf):
    return jax.devices() if isinstance(leaf, jax.core.Tracer) else leaf.devices()
