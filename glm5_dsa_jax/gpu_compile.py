"""Compile every Pallas kernel for NVIDIA GPUs on a host without one, and check what came out.

No GPU is needed: XLA compiles for a *compile-only* CUDA device built from a description of
the GPU (``jax.experimental.topologies.get_topology_desc(..., "cuda", target_config=...)``,
from ``jax-cuda12-plugin``; no driver is loaded). Per target and case:

1. the kernel's public wrapper (``implementation="pallas"``) is traced on abstract inputs
   at the shapes the layer gives it for one step (``KERNELS`` x ``default_cases``), with
   the compile-only device as the default device (jax >= 0.11's Pallas reads the compute
   capability from it; 0.10 assumes 9.0, which only affects fp8 casts, unused here);
2. ``.lower().compile()`` runs XLA's Triton -> LLVM -> PTX -> cubin pipeline, dumping the
   PTX and the thunk sequence (XLA itself rejects a kernel over the shared-memory limit);
3. ``ptxas -v`` on the dumped PTX of each Triton kernel gives registers, spills, stack frame
   and static shared memory; the thunk sequence gives the launch's threads and dynamic
   shared memory; blocks per SM follow from those by the CUDA occupancy rules
   (``GpuTarget.blocks_per_sm``).

A kernel passes when it compiled, spills nothing, has no stack frame (local memory is as
slow as a spill), fits the target's shared memory per block, and at least one block fits an
SM. Invariants:

* A number that cannot be read (no thunk, no ptxas line) fails the kernel: a check that has
  lost its data must not pass.
* Each target compiles in its own subprocess (``python -m glm5_dsa_jax.gpu_compile
  --worker``): XLA aborts the process on some fatal errors, and the caller (pytest) must
  survive to report them; the caller's jax setup (8 virtual CPU devices) stays out of it.
* Work is shared, never skipped: cases whose wrapper inputs are identical are traced once,
  and cases whose Triton kernels (IR bytes, warps, stages) are identical are compiled once
  (``Report.same_as`` names the case that compiled it). A kernel's registers and shared
  memory depend only on its IR and the target, not on the grid.

Adding a kernel is one ``KERNELS`` entry: a function from the model config and a ``Step``
to the wrapper call and its abstract inputs. Needs the ``gpu-compile`` extra
(``toolchain()`` says what is missing).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable

__all__ = [
    "GpuTarget", "TARGETS", "Step", "Case", "KERNELS", "REACHED_THROUGH", "default_cases", "Report",
    "ToolchainMissing", "toolchain", "compile_cases", "format_table", "main",
]

EXTRA = "gpu-compile"
INSTALL_HINT = (
    f"install the {EXTRA!r} extra: pip install -e '.[{EXTRA}]' (jax-cuda12-plugin and "
    "jax-cuda12-pjrt of the installed jax's version, and ptxas from nvidia-cuda-nvcc-cu12)"
)


# ------------------------------------------------------------------------------ targets
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
    )
}


# -------------------------------------------------------------------------------- cases
PREFILL_CHUNK = 4096  # tokens of one prefill chunk (the layer takes chunks of any length)
CONTEXTS = (4096, 131072, 1 << 20)  # cache capacity in tokens; 1M = max_position_embeddings
BATCHES = (1, 8)
STEPS = ("decode", "prefill", "prompt")
DTYPES = ("bfloat16",)  # the serving dtype; "float32" is the layer's other compute dtype


@dataclasses.dataclass(frozen=True)
class Step:
    """The shapes one layer step gives the kernels (see ``DsaAttention._step``).

    ``decode``: one new token; ``prefill``: a chunk of ``PREFILL_CHUNK`` tokens;
    ``prompt``: a one-shot prefill of the whole context. The cache holds ``context`` slots
    (``pools = context // kpool`` pooled keys); queries go through the indexer and attention
    in tiles of ``block_q`` (the layer's default, 64); pooling runs over a window of the
    last ``kpool`` cached slots plus the chunk.
    """

    kind: str
    batch: int
    context: int
    dtype: str = "bfloat16"  # the layer's compute and cache dtype
    block_q: int = 64

    def __post_init__(self):
        if self.kind not in STEPS:
            raise ValueError(f"Step.kind must be one of {STEPS}, got {self.kind!r}")
        for name in ("batch", "context", "block_q"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Step.{name} must be a positive int, got {v!r}")

    @property
    def chunk(self) -> int:
        return {"decode": 1, "prefill": min(PREFILL_CHUNK, self.context),
                "prompt": self.context}[self.kind]

    @property
    def queries(self) -> int:
        return min(self.block_q, self.chunk)


def _kpool_compress(cfg, s: Step, blocks: dict):
    import jax.numpy as jnp
    from pallas_kernels import kpool_compress

    b, w, d, dt = s.batch, s.chunk + cfg.index_kpool, cfg.index_head_dim, jnp.dtype(s.dtype)
    fn = lambda k, g, v, ape, first: kpool_compress(  # noqa: E731
        k, g, v, ape, first, implementation="pallas", **blocks)
    return fn, [((b, w, d), dt), ((b, w, d), jnp.float32), ((b, w), jnp.bool_),
                ((cfg.index_kpool, d), dt), ((b,), jnp.int32)]


def _index_scores(cfg, s: Step, blocks: dict):
    import jax.numpy as jnp
    from pallas_kernels import index_scores

    b, q, p, dt = s.batch, s.queries, max(1, s.context // cfg.index_kpool), jnp.dtype(s.dtype)
    h, d, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    fn = lambda qi, w, pooled, pv, fk, qp: index_scores(  # noqa: E731
        qi, w, pooled, pv, fk, qp, kpool=kp, implementation="pallas", **blocks)
    return fn, [((b, q, h, d), dt), ((b, q, h), jnp.float32), ((b, p, d), dt),
                ((b, p), jnp.bool_), ((b,), jnp.int32), ((b, q), jnp.int32)]


def _topk_pools(cfg, s: Step, blocks: dict):
    import jax.numpy as jnp
    from pallas_kernels import topk_pools

    p = max(1, s.context // cfg.index_kpool)
    k = cfg.select_k(p)
    fn = lambda scores: topk_pools(scores, k, implementation="pallas", **blocks)  # noqa: E731
    return fn, [((s.batch, s.queries, p), jnp.float32)], (k,)


def _expand_selection(cfg, s: Step, blocks: dict):
    import jax.numpy as jnp
    from pallas_kernels import expand_selection

    b, q, kp, ow = s.batch, s.queries, cfg.index_kpool, cfg.out_width
    k = cfg.select_k(max(1, s.context // kp))
    avals = [((b, q, k), jnp.int32), ((b,), jnp.int32)]
    if cfg.tail_width:
        avals.append(((b, q, cfg.tail_width), jnp.int32))
        fn = lambda pools, fk, tail: expand_selection(  # noqa: E731
            pools, fk, tail, kpool=kp, out_width=ow, implementation="pallas", **blocks)
    else:
        fn = lambda pools, fk: expand_selection(  # noqa: E731
            pools, fk, None, kpool=kp, out_width=ow, implementation="pallas", **blocks)
    return fn, avals


def _sparse_mla(cfg, s: Step, blocks: dict):
    import jax.numpy as jnp
    from pallas_kernels import sparse_mla

    b, q, dt, c = s.batch, s.queries, jnp.dtype(s.dtype), cfg.kv_lora_rank
    scale = cfg.softmax_scale
    fn = lambda ql, lat, ids: sparse_mla(  # noqa: E731
        ql, lat, ids, scale=scale, implementation="pallas", **blocks)
    return fn, [((b, q, cfg.num_attention_heads, c), dt), ((b, s.context, c), dt),
                ((b, q, cfg.out_width), jnp.int32)]


#: One entry per kernel: ``(cfg, step, blocks) -> (fn, [(shape, dtype), ...][, static])``.
#: ``fn`` calls the public wrapper with ``implementation="pallas"`` and ``**blocks`` (empty
#: in the default cases: the wrapper's own block sizes); the optional third item lists the
#: static arguments not visible in the input shapes (they join the key under which cases
#: share a trace).
KERNELS: dict[str, Callable] = {
    "kpool_compress": _kpool_compress,
    "index_scores": _index_scores,
    "topk_pools": _topk_pools,
    "expand_selection": _expand_selection,
    "sparse_mla": _sparse_mla,
}

#: Kernel modules of ``pallas_kernels`` without an entry of their own, mapped to the
#: ``KERNELS`` entry whose wrapper launches their kernels (e.g. a helper module of
#: ``topk_pools``). ``tests/test_gpu_compile.py`` requires every module that calls
#: ``pallas_call`` to be in ``KERNELS`` or here.
REACHED_THROUGH: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel at one step; ``blocks`` (``(name, value)`` pairs) overrides the wrapper's
    block sizes (none in the default cases)."""

    kernel: str
    step: Step
    blocks: tuple = ()

    @property
    def id(self) -> str:
        s = self.step
        dt = "" if s.dtype == "bfloat16" else f" {s.dtype}"
        bl = "".join(f" {k}={v}" for k, v in self.blocks)
        return f"{self.kernel} {s.kind} b{s.batch} {_tokens(s.context)}{dt}{bl}"


def _tokens(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def default_cases(kernels: Iterable[str] | None = None, *, contexts=CONTEXTS, batches=BATCHES,
                  steps=STEPS, dtypes=DTYPES) -> list[Case]:
    """Every kernel at every step, context, batch and dtype (by default bfloat16, the
    serving dtype, at 4K, 128K and 1M tokens, batch 1 and 8)."""
    kernels = list(KERNELS) if kernels is None else list(kernels)
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {sorted(KERNELS)}")
    for name, values in (("contexts", contexts), ("batches", batches)):
        if not values or any(not isinstance(v, int) or v <= 0 for v in values):
            raise ValueError(f"{name} must be positive ints, got {list(values)}")
    if not steps or set(steps) - set(STEPS):
        raise ValueError(f"steps must be among {STEPS}, got {list(steps)}")
    if not dtypes or set(dtypes) - {"bfloat16", "float32"}:
        raise ValueError(f"dtypes must be among ('bfloat16', 'float32'), got {list(dtypes)}")
    return [Case(k, Step(kind, b, n, dt)) for k in kernels for dt in dtypes for n in contexts
            for kind in steps for b in batches]


def _build(cfg, case: Case):
    out = KERNELS[case.kernel](cfg, case.step, dict(case.blocks))
    fn, avals = out[0], out[1]
    static = out[2] if len(out) > 2 else ()
    key = (case.kernel, tuple((tuple(sh), str(dt)) for sh, dt in avals), tuple(static),
           case.blocks)
    return fn, avals, key


# ------------------------------------------------------------------------------ toolchain
class ToolchainMissing(RuntimeError):
    """The compile toolchain (the ``gpu-compile`` extra) is not installed."""


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def find_ptxas() -> str | None:
    """ptxas of ``nvidia-cuda-nvcc-cu12`` (the one XLA itself finds), else on ``PATH``."""
    try:
        import nvidia.cuda_nvcc as nvcc  # noqa: PLC0415

        for base in getattr(nvcc, "__path__", []):
            path = os.path.join(base, "bin", "ptxas")
            if os.access(path, os.X_OK):
                return path
    except ImportError:
        pass
    return shutil.which("ptxas")


def toolchain() -> dict:
    """Versions of what the compile needs and the ptxas path. Raises ``ToolchainMissing``
    (the extra to install) when the plugin or ptxas is absent, and ``RuntimeError`` when
    the plugin's version differs from jaxlib's (XLA and the plugin must be one build)."""
    info = {d: _version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")}
    ptxas = find_ptxas()
    missing = [d for d in ("jax-cuda12-plugin", "jax-cuda12-pjrt") if info[d] is None]
    if ptxas is None:
        missing.append("ptxas (nvidia-cuda-nvcc-cu12)")
    if missing:
        raise ToolchainMissing(f"not installed: {', '.join(missing)}; {INSTALL_HINT}")
    for d in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        if info[d] != info["jaxlib"]:
            raise RuntimeError(
                f"{d} {info[d]} does not match jaxlib {info['jaxlib']}: the plugin must be the "
                f"same build as jaxlib; pip install -e '.[{EXTRA}]' (it pins them to jax's version)"
            )
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    info["ptxas"] = ptxas
    info["ptxas_version"] = (re.findall(r"V[\d.]+", out) or ["?"])[0]
    return info


# --------------------------------------------------------------------------------- worker
_IR_RE = re.compile(r'\bir = "((?:\\.|[^"\\])*)"')


def _triton_signature(lowered) -> tuple:
    """What identifies the compiled Triton kernels of a lowered module: per launch its name,
    a hash of its IR bytes, warps and stages."""
    from pallas_kernels._common import triton_calls

    text = lowered.as_text()
    irs = [hashlib.sha256(m.group(1).encode()).hexdigest()[:16]
           for line in text.splitlines() if "__gpu$xla.gpu.triton" in line
           for m in [_IR_RE.search(line)] if m]
    calls = triton_calls(text)
    return calls, tuple(sorted((c["name"], ir, c["num_warps"], c["num_stages"])
                               for c, ir in zip(calls, irs)))


def _worker(target_name: str, dump_root: str) -> int:
    """Compile the cases read from stdin for one target; one JSON line per case."""
    import jax
    from jax.experimental import topologies

    from glm5_dsa_jax.config import DsaConfig

    spec = json.load(sys.stdin)
    cfg = DsaConfig.glm53_flash(**spec.get("config", {}))
    target = TARGETS[target_name]
    topo = topologies.get_topology_desc(
        f"glm5_dsa_{target.name}", "cuda", target_config=target.target_config(), topology="1x1x1")
    device = topo.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    print(json.dumps({"event": "ready", "device": str(device)}), flush=True)
    traced_as: dict = {}  # input key -> case id
    compiled_as: dict = {}  # Triton signature -> case id
    for item in spec["cases"]:
        case = Case(item["kernel"], Step(**item["step"]), tuple(map(tuple, item.get("blocks", ()))))
        rec = {"event": "case", "id": case.id, "ok": False, "stage": "trace", "error": None,
               "calls": [], "same_as": None, "dump": None}
        t0 = time.time()
        try:
            fn, avals, key = _build(cfg, case)
            if key in traced_as:
                rec.update(ok=True, stage="done", same_inputs_as=traced_as[key])
                print(json.dumps(rec), flush=True)
                continue
            traced_as[key] = case.id
            avals = [jax.ShapeDtypeStruct(sh, dt, sharding=sharding) for sh, dt in avals]
            with jax.default_device(device):
                lowered = jax.jit(fn).trace(*avals).lower()
            rec["stage"] = "compile"
            calls, sig = _triton_signature(lowered)
            rec["calls"] = calls
            if not calls:
                raise RuntimeError("the lowered module has no Triton kernel launch")
            if sig in compiled_as:
                rec["same_as"] = compiled_as[sig]
            else:
                dump = os.path.join(dump_root, re.sub(r"[^\w.-]+", "_", case.id))
                rec["dump"] = dump
                lowered.compile(compiler_options={
                    "xla_dump_to": dump,
                    # jax >= 0.11 dumps Triton's PTX only when its emitter is named ("ptx":
                    # only the PTX, not the per-pass IR that ".*" also writes).
                    "xla_dump_emitter_re": "ptx",
                    "xla_gpu_force_compilation_parallelism": 1,
                })
                compiled_as[sig] = case.id
            rec.update(ok=True, stage="done")
        except Exception as e:  # noqa: BLE001 - every failure is reported, the rest go on
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["seconds"] = round(time.time() - t0, 2)
        print(json.dumps(rec), flush=True)
    return 0


# -------------------------------------------------------------------------------- analysis
@dataclasses.dataclass
class Report:
    """One Triton launch of one case on one target (or the case's failure)."""

    target: str
    case: str
    kernel: str
    grid: tuple | None = None
    warps: int | None = None
    regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    smem_dynamic: int | None = None
    smem_static: int | None = None
    blocks_per_sm: int | None = None
    limiter: str | None = None
    smem_limit: int | None = None
    same_as: str | None = None  # the case whose compile these numbers come from
    error: str | None = None
    problems: tuple = ()

    @property
    def smem(self) -> int | None:
        if self.smem_dynamic is None or self.smem_static is None:
            return None
        return self.smem_dynamic + self.smem_static

    @property
    def ok(self) -> bool:
        return not self.problems


_THUNK_RE = re.compile(
    r"^\s*\d+:\s+(\w+)\s+\[[^\]]*\]\s+(\S+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+"
    r"threads:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+shared_memory:\s*(\d+)\s*bytes")


def parse_thunks(text: str) -> list[dict]:
    """Kernel launches of an XLA ``*.thunk_sequence.txt``: kind, name, grid, threads per
    block and dynamic shared memory."""
    out = []
    for line in text.splitlines():
        m = _THUNK_RE.match(line)
        if m:
            g = m.groups()
            out.append(dict(kind=g[0], name=g[1], grid=tuple(int(x) for x in g[2:5]),
                            threads=math.prod(int(x) for x in g[5:8]), smem=int(g[8])))
    return out


def parse_ptxas(text: str) -> dict[str, dict]:
    """Per entry function of ``ptxas -v`` output: regs, spill stores/loads, stack, static
    shared memory."""
    funcs: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?", line)
        if m:
            cur = funcs.setdefault(m.group(1), {"smem_static": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                       spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem_static"] = int(s.group(1)) if s else 0
    return funcs


def _ptxas_stats(ptxas: str, dump: str, names: set[str]) -> tuple[dict, list[str]]:
    """ptxas -v every dumped PTX file that defines one of ``names``."""
    stats, errors = {}, []
    for fn in sorted(os.listdir(dump)):
        if not fn.endswith(".ptx"):
            continue
        path = os.path.join(dump, fn)
        with open(path) as f:
            text = f.read()
        entries = set(re.findall(r"\.entry\s+([\w$.]+)\s*\(", text))
        target = re.search(r"^\s*\.target\s+(\w+)", text, re.M)
        if not entries & names or target is None:
            continue
        with tempfile.TemporaryDirectory() as td:
            proc = subprocess.run(
                [ptxas, f"-arch={target.group(1)}", "-v", path, "-o", os.path.join(td, "k.cubin")],
                capture_output=True, text=True)
        if proc.returncode:
            errors.append(f"ptxas {fn}: {(proc.stdout + proc.stderr).strip()[-2000:]}")
        stats.update({k: v for k, v in parse_ptxas(proc.stdout + proc.stderr).items() if k in names})
    return stats, errors


def _analyse(target: GpuTarget, rec: dict, compiled: dict, ptxas: str) -> list[Report]:
    base = dict(target=target.name, case=rec["id"], smem_limit=target.smem_per_block_optin)
    if not rec.get("ok"):
        return [Report(kernel=rec["id"].split()[0], error=rec.get("error") or "failed",
                       problems=("COMPILE",), **base)]
    source = compiled.get(rec.get("same_as") or rec["id"])
    if source is None or not source.get("launches"):
        why = (source or {}).get("error") or "no Triton kernel launch in XLA's thunk sequence"
        return [Report(kernel=rec["id"].split()[0], same_as=rec.get("same_as"), error=why,
                       problems=("NO-STATS",), **base)]
    grids = {c["name"]: tuple(c["grid"]) for c in rec["calls"]}
    reports = []
    for launch in source["launches"]:
        st = source["stats"].get(launch["name"], {})
        r = Report(kernel=launch["name"], grid=grids.get(re.sub(r"(_\d+)+$", "", launch["name"]),
                                                         grids.get(launch["name"], launch["grid"])),
                   warps=launch["threads"] // 32, regs=st.get("regs"),
                   spill_stores=st.get("spill_stores"), spill_loads=st.get("spill_loads"),
                   stack=st.get("stack"), smem_dynamic=launch["smem"],
                   smem_static=st.get("smem_static"), same_as=rec.get("same_as"), **base)
        problems = []
        if r.regs is None or r.stack is None:
            problems.append("NO-STATS")
            r.error = "; ".join(source["errors"]) or f"ptxas printed no stats for {launch['name']}"
        else:
            if r.spill_stores or r.spill_loads:
                problems.append("SPILL")
            if r.stack:
                problems.append("STACK")
            if r.smem > target.smem_per_block_optin:
                problems.append("SMEM")
            r.blocks_per_sm, r.limiter = target.blocks_per_sm(launch["threads"], r.regs, r.smem)
            if r.blocks_per_sm == 0:
                problems.append("NO-FIT")
        r.problems = tuple(problems)
        reports.append(r)
    return reports


def _run_worker(target: GpuTarget, cases: list[Case], dump_root: str, timeout: float,
                config: dict) -> dict[str, dict]:
    """Run the worker for one target; after a crash, go on past the case that caused it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    records: dict[str, dict] = {}
    todo = list(cases)
    deadline = time.time() + timeout
    while todo:
        spec = {"config": config, "cases": [
            {"kernel": c.kernel, "step": dataclasses.asdict(c.step), "blocks": c.blocks}
            for c in todo]}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "glm5_dsa_jax.gpu_compile", "--worker", target.name,
                 "--dump-dir", dump_root], input=json.dumps(spec), capture_output=True,
                text=True, env=env, timeout=max(1.0, deadline - time.time()))
            out, err, how = proc.stdout, proc.stderr, f"exited with status {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            how = f"ran past the {timeout:.0f} s limit"
        ready = False
        for line in out.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            ready |= rec.get("event") == "ready"
            if rec.get("event") == "case":
                records[rec["id"]] = rec
        todo = [c for c in todo if c.id not in records]
        if todo:
            tail = "\n".join(err.strip().splitlines()[-30:])
            dead = todo if not ready or "limit" in how else todo[:1]
            for c in dead:
                records[c.id] = {"id": c.id, "ok": False, "error":
                                 f"the {target.name} compile process {how} "
                                 f"{'before it started' if not ready else 'on this case'}:\n{tail}"}
            todo = todo[len(dead):]
    return records


def compile_cases(cases: list[Case], targets: Iterable[str] = ("sm_80", "sm_90"), *,
                  dump_dir: str | None = None, timeout: float = 1800.0,
                  config: dict | None = None, log=None) -> list[Report]:
    """Compile ``cases`` for each target (one worker process per target, run one after
    the other: the compile is CPU-bound) and return one ``Report`` per Triton launch.
    ``dump_dir`` keeps XLA's dumps (HLO, PTX, thunks); ``config`` overrides fields of the
    GLM-5.3-Flash preset. Raises ``ToolchainMissing`` without the ``gpu-compile`` extra."""
    info = toolchain()
    names = list(targets)
    for n in names:
        if n not in TARGETS:
            raise ValueError(f"unknown target {n!r}; known: {sorted(TARGETS)}")
    ids = [c.id for c in cases]
    if len(set(ids)) != len(ids):
        raise ValueError("cases must be distinct")
    root = dump_dir or tempfile.mkdtemp(prefix="glm5_gpu_compile_")
    reports: list[Report] = []
    try:
        for n in names:
            t0 = time.time()
            target_dump = os.path.join(root, n)
            os.makedirs(target_dump, exist_ok=True)
            records = _run_worker(TARGETS[n], cases, target_dump, timeout, config or {})
            compiled = {}
            for rec in records.values():
                if rec.get("dump") and os.path.isdir(rec["dump"]):
                    # The Triton launches: thunks named after a Triton call of the lowered
                    # module (XLA may add "_1"...; its own fusions are kCustomKernel on 0.12).
                    triton = {c["name"] for c in rec["calls"]}
                    launches = []
                    for fn in sorted(os.listdir(rec["dump"])):
                        if fn.endswith(".thunk_sequence.txt"):
                            with open(os.path.join(rec["dump"], fn)) as f:
                                launches += [t for t in parse_thunks(f.read())
                                             if re.sub(r"(_\d+)+$", "", t["name"]) in triton
                                             or t["name"] in triton]
                    launches = list({t["name"]: t for t in launches}.values())
                    stats, errors = _ptxas_stats(info["ptxas"], rec["dump"],
                                                 {t["name"] for t in launches})
                    compiled[rec["id"]] = dict(launches=launches, stats=stats, errors=errors)
                elif not rec.get("ok"):
                    compiled[rec["id"]] = dict(launches=[], error=rec.get("error"))
            for c in cases:
                rec = records[c.id]
                if rec.get("same_inputs_as"):  # traced once: same inputs as an earlier case
                    first = records[rec["same_inputs_as"]]
                    rec = dict(first, id=c.id, same_as=first.get("same_as") or first["id"])
                reports += _analyse(TARGETS[n], rec, compiled, info["ptxas"])
            if log:
                log(f"{n}: {len(cases)} cases in {time.time() - t0:.0f} s")
    finally:
        if dump_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return reports


# ---------------------------------------------------------------------------------- table
_HEADER = ("target", "kernel", "case", "grid", "warps", "regs", "spill st/ld", "stack",
           "smem B", "% limit", "blocks/SM", "status")


def _row(r: Report, case: str) -> tuple:
    dash = lambda v: "-" if v is None else str(v)  # noqa: E731
    return (
        r.target, r.kernel, case, "x".join(map(str, r.grid)) if r.grid else "-", dash(r.warps),
        dash(r.regs), "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}",
        dash(r.stack), dash(r.smem),
        "-" if r.smem is None else f"{100 * r.smem / r.smem_limit:.0f}%",
        "-" if r.blocks_per_sm is None else f"{r.blocks_per_sm} ({r.limiter})",
        "ok" if r.ok else "+".join(r.problems),
    )


def format_table(reports: list[Report], *, compact: bool = False) -> str:
    """The reports as a text table (one row per launch and case). ``compact`` merges the
    cases of one kernel and step whose numbers are equal into one row (grid dropped)."""
    rows = []
    if compact:
        groups: dict = {}
        for r in reports:
            parts = r.case.split()
            key = (r.target, r.kernel, " ".join(parts[1:2] + parts[4:]),
                   r.warps, r.regs, r.spill_stores, r.spill_loads, r.stack, r.smem,
                   r.blocks_per_sm, r.limiter, r.problems)
            groups.setdefault(key, []).append(r)
        for key, rs in groups.items():
            by_batch: dict = {}  # batch -> contexts, in case order
            for r in rs:
                parts = r.case.split()
                by_batch.setdefault(parts[2], []).append(parts[3])
            merged: dict = {}  # contexts -> batches with exactly those contexts
            for b, ctxs in by_batch.items():
                merged.setdefault(",".join(ctxs), []).append(b[1:])
            label = f"{key[2]} " + " / ".join(f"b{','.join(bs)} {c}" for c, bs in merged.items())
            row = list(_row(dataclasses.replace(rs[0], grid=None), label))
            del row[3]
            rows.append(tuple(row))
        header = _HEADER[:3] + _HEADER[4:]
    else:
        rows = [_row(r, r.case) for r in reports]
        header = _HEADER
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt("-" * w for w in widths)] + [fmt(r) for r in rows])


def failures(reports: list[Report]) -> str:
    """The failed reports with their errors, one block each."""
    out = []
    for r in reports:
        if not r.ok:
            head = f"[{r.target} {r.case} {r.kernel}] {'+'.join(r.problems)}"
            out.append(head + ("" if not r.error else "\n  " + r.error.replace("\n", "\n  ")))
    return "\n".join(out)


# ------------------------------------------------------------------------------------ CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m glm5_dsa_jax.gpu_compile",
        description="Compile every Pallas kernel at the GLM-5.3-Flash shapes for sm_80 and "
                    "sm_90 without a GPU; print registers, spills, stack, shared memory and "
                    "blocks per SM. Exit 0: all ok; 1: a kernel failed; 2: setup error.")
    ap.add_argument("--targets", default="sm_80,sm_90", help="comma list (default sm_80,sm_90)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma list (default: all)")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                    help="cache lengths in tokens (default 4096,131072,1048576)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="default 1,8")
    ap.add_argument("--steps", default=",".join(STEPS), help="decode,prefill,prompt (default all)")
    ap.add_argument("--dtypes", default=",".join(DTYPES),
                    help="bfloat16 (default; the serving dtype), float32, or both")
    ap.add_argument("--compact", action="store_true", help="merge cases with equal numbers")
    ap.add_argument("--json", help="write every report here")
    ap.add_argument("--dump-dir", help="keep XLA's dumps (HLO, PTX, thunk sequence) here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.dump_dir)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        cases = default_cases(split(args.kernels), contexts=[int(x) for x in split(args.contexts)],
                              batches=[int(x) for x in split(args.batches)],
                              steps=split(args.steps), dtypes=split(args.dtypes))
        info = toolchain()
        print(f"jax {info['jax']}, jaxlib {info['jaxlib']}, jax-cuda12-plugin "
              f"{info['jax-cuda12-plugin']}, ptxas {info['ptxas_version']}", flush=True)
        t0 = time.time()
        reports = compile_cases(cases, split(args.targets), dump_dir=args.dump_dir,
                                log=lambda m: print(m, flush=True))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(reports, compact=args.compact))
    bad = [r for r in reports if not r.ok]
    if bad:
        print("\n" + failures(reports))
    print(f"\n{len(reports)} launches, {len(bad)} failed; {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(toolchain=info, reports=[dict(dataclasses.asdict(r), ok=r.ok)
                                                    for r in reports]), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
