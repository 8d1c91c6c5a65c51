"""What the Mosaic GPU kernels share: when they can run, and the checks they all make.

The scoring and attention kernels (``mosaic_scoring``, ``mosaic_attention``) multiply on
Hopper's tensor cores with ``wgmma``. Invariants:

* They take two operands of one 16-bit float dtype only (``takes_dtypes``): ``wgmma``'s
  float32 is TF32, not IEEE, and the kernels promise the reference's float32 products.
* They run only on a target with ``wgmma`` (``wgmma_on_target``): Blackwell (compute
  capability >= 10) has none, and its compile aborts the process rather than failing.
* ``mosaic_takes`` is the conjunction; where it is false, a wrapper asked for ``"mosaic"``
  runs its Triton kernel instead (as a step without a Mosaic kernel does), so a float32
  layer, or any layer on Blackwell, still runs. Where a Mosaic kernel is called directly
  on other dtypes, ``check_16bit_operands`` refuses them with one message for both kernels.
* Block sizes whose shared memory exceeds a Hopper CTA's (``SMEM_BYTES``) raise
  ``ValueError`` before the launch (``check_smem``): the lowering does not check it, the
  launch would fail on the GPU.

This module is private and imports no kernel module, so the Triton modules can ask
``mosaic_takes`` without importing a Mosaic one.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._common import target_device

__all__ = [
    "SMEM_BYTES", "check_smem", "takes_dtypes", "wgmma_on_target", "mosaic_takes",
    "check_16bit_operands",
]

SMEM_BYTES = 227 * 1024  # the most shared memory one CTA may use on Hopper (sm_90)


def check_smem(owner: str, buffers: dict[str, int], blocks) -> None:
    """A ``ValueError`` naming ``blocks`` and the buffers when their bytes exceed
    ``SMEM_BYTES`` (a launch would fail on the GPU; the lowering does not check it)."""
    total = sum(buffers.values())
    if total > SMEM_BYTES:
        parts = ", ".join(f"{k} {v}" for k, v in buffers.items())
        raise ValueError(
            f"{owner}: {blocks} needs {total} bytes of shared memory ({parts}), more than "
            f"the {SMEM_BYTES} a Hopper CTA has; use smaller blocks"
        )



def takes_dtypes(*dtypes) -> bool:
    """Whether the Mosaic kernels (scores and attention) take operands of these dtypes: one
    16-bit float dtype (wgmma's float32 is TF32)."""
    kinds = {jnp.dtype(d) for d in dtypes}
    return len(kinds) == 1 and kinds <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}


def wgmma_on_target() -> bool:
    """Whether the device the trace targets can run these kernels' ``wgmma``: anything but
    a CUDA GPU of compute capability 10 or newer. Blackwell has no ``wgmma`` (its MMAs are
    ``tcgen05``; LLVM cannot select ``wgmma`` for sm_100a and the compile aborts the
    process); interpret mode and the abstract H100 of ``cuda_lowering`` are fine."""
    platform, capability = target_device()
    return not (platform in ("cuda", "gpu") and capability is not None and capability[0] >= 10)


def mosaic_takes(*dtypes) -> bool:
    """Whether the wrappers run the Mosaic scoring / attention kernel on operands of these
    dtypes here: 16-bit operands (``takes_dtypes``) on a target with ``wgmma``
    (``wgmma_on_target``). Otherwise they run the Triton kernel (IEEE float32; any GPU), as
    a step with no Mosaic kernel does (see ``pallas_kernels.scoring``), so a float32 layer,
    or any layer on a Blackwell GPU, asked for ``"mosaic"`` (or ``"auto"``) still runs."""
    return takes_dtypes(*dtypes) and wgmma_on_target()


def check_16bit_operands(kernel: str, **operands) -> None:
    """``ValueError`` unless the two ``operands`` (name: array) of the Mosaic ``kernel`` are of
    one 16-bit float dtype (``takes_dtypes``): its MMAs are ``wgmma``'s, whose float32 is
    TF32, not IEEE (shared by the scoring and attention wrappers, one message)."""
    if not takes_dtypes(*(x.dtype for x in operands.values())):
        names = " and ".join(operands)
        got = " and ".join(f"{name} {x.dtype}" for name, x in operands.items())
        raise ValueError(
            f"the mosaic {kernel} multiplies 16-bit operands on the tensor cores (wgmma's "
            f"float32 is TF32): {names} must both be bfloat16 or both float16, got {got}"
        )
