"""The GPUs ``glm5_dsa_jax.tools.gpu_compile`` compiles for, and the CUDA occupancy rules.

Invariants: a ``GpuTarget`` holds exactly what XLA is told about the GPU
(``target_config``) and the per-SM limits blocks per SM are computed from; the numbers are
the CUDA C++ Programming Guide's table per compute capability and the GPUs' data sheets
(those of XLA's own spec files). ``blocks_per_sm`` is 0 when one block does not fit (the
launch would fail), never an optimistic guess.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GpuTarget", "TARGETS"]


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU to compile for: what XLA is told (``target_config``) and the per-SM limits
    that blocks per SM are computed from. Numbers: the CUDA C++ Programming Guide's table
    per compute capability and the GPUs' data sheets (those of XLA's own spec files)."""

    name: str  # "sm_80"
    device: str  # device_description_str; jax >= 0.11 maps it to a compute capability
    compute_capability: tuple[int, int]
    sm_count: int
    fpus_per_sm: int
    clock_ghz: float
    memory_bandwidth: int  # bytes/s
    l2_bytes: int
    memory_bytes: int
    smem_per_block_optin: int  # the most dynamic + static shared memory of one block
    smem_per_sm: int  # the largest carveout
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    threads_per_sm: int = 2048
    threads_per_block: int = 1024
    max_blocks_per_sm: int = 32
    # Occupancy rules (sm_80 / sm_90): registers go to warps in units of 256 from one of 4
    # sub-partitions of the register file; shared memory in units of 128 bytes, plus 1 KiB
    # the system reserves per resident block.
    reg_alloc_unit: int = 256
    reg_partitions: int = 4
    smem_alloc_unit: int = 128
    smem_reserved_per_block: int = 1024

    def target_config(self) -> str:
        """The ``GpuTargetConfigProto`` text XLA compiles against."""
        major, minor = self.compute_capability
        info = dict(
            threads_per_block_limit=self.threads_per_block, threads_per_warp=32,
            shared_memory_per_block=49152, shared_memory_per_core=self.smem_per_sm,
            threads_per_core_limit=self.threads_per_sm, core_count=self.sm_count,
            fpus_per_core=self.fpus_per_sm, block_dim_limit_x=2**31 - 1,
            block_dim_limit_y=65535, block_dim_limit_z=65535,
            memory_bandwidth=self.memory_bandwidth, l2_cache_size=self.l2_bytes,
            clock_rate_ghz=self.clock_ghz, device_memory_size=self.memory_bytes,
            shared_memory_per_block_optin=self.smem_per_block_optin,
        )
        lines = [f"  {k}: {v}" for k, v in info.items()]
        lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
        lines += [f"  registers_per_core_limit: {self.regs_per_sm}",
                  f"  registers_per_block_limit: {self.regs_per_block}"]
        return ("gpu_device_info {\n" + "\n".join(lines) + "\n}\n"
                f'platform_name: "CUDA"\ndevice_description_str: "{self.device}"\n')

    def blocks_per_sm(self, threads: int, regs: int, smem: int) -> tuple[int, str]:
        """Resident blocks per SM of a kernel with ``threads`` per block, ``regs`` per
        thread and ``smem`` bytes of shared memory per block, and what limits it
        (``"regs"``, ``"smem"``, ``"threads"`` or ``"blocks"``); ``0`` when one block does
        not fit (the launch would fail)."""
        warps = -(-threads // 32)
        regs_per_warp = -(-max(regs, 1) * 32 // self.reg_alloc_unit) * self.reg_alloc_unit
        if -(-warps // self.reg_partitions) * self.reg_partitions * regs_per_warp > self.regs_per_block:
            by_regs = 0  # the hardware's per-block check, as if all partitions were used
        else:
            per_partition = (self.regs_per_sm // self.reg_partitions) // regs_per_warp
            by_regs = per_partition * self.reg_partitions // warps
        smem_block = -(-(smem + self.smem_reserved_per_block) // self.smem_alloc_unit) * self.smem_alloc_unit
        limits = {
            "regs": by_regs,
            "smem": 0 if smem > self.smem_per_block_optin else self.smem_per_sm // smem_block,
            "threads": 0 if threads > self.threads_per_block else self.threads_per_sm // (warps * 32),
            "blocks": self.max_blocks_per_sm,
        }
        which = min(limits, key=limits.get)
        return limits[which], which


TARGETS = {
    t.name: t
    for t in (
        GpuTarget("sm_80", "NVIDIA A100-SXM4-80GB", (8, 0), sm_count=108, fpus_per_sm=64,
                  clock_ghz=1.41, memory_bandwidth=2_039_040_000_000, l2_bytes=40 << 20,
                  memory_bytes=85_100_068_864, smem_per_block_optin=166_912,
                  smem_per_sm=167_936),
        # H200 has the same SM (sm_90, same limits); only memory size and bandwidth differ.
        GpuTarget("sm_90", "NVIDIA H100 80GB HBM3", (9, 0), sm_count=132, fpus_per_sm=128,
                  clock_ghz=1.98, memory_bandwidth=3_352_320_000_000, l2_bytes=50 << 20,
                  memory_bytes=84_978_434_048, smem_per_block_optin=232_448,
                  smem_per_sm=233_472),
        # B200 (sm_100, the data-center Blackwell SM): the same per-SM limits as sm_90
        # (CUDA Programming Guide, compute capability 10.0: 228 KiB of shared memory per SM,
        # 227 KiB per block, 64K registers, 2048 threads, 32 blocks).
        GpuTarget("sm_100", "NVIDIA B200", (10, 0), sm_count=148, fpus_per_sm=128,
                  clock_ghz=1.965, memory_bandwidth=8_000_000_000_000, l2_bytes=126 << 20,
                  memory_bytes=191_476_400_128, smem_per_block_optin=232_448,
                  smem_per_sm=233_472),
    )
}
