"""Compile a whole DSA layer step for an H200 on a host without a GPU, and read its kernels.

XLA's GPU compiler runs without a device when jax is given a target description
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``, from
the CUDA plugin; no driver is loaded). The result is the optimized HLO the GPU would run:
its fusions, custom calls (the Pallas kernels, cuBLAS), copies, conditionals and loops.
Autotuning needs a device, so XLA picks its GEMM configurations by heuristics: kernel counts
and fusion shapes are what to read here, not times.

The step is ``decode.make_step``'s, given what it gives a GPU: the parameters are abstract
(no devices), so the step applies the GPU product policy (``cpu_policy``, "Products on a
GPU") and reads the contraction-last copies ``step.compute_params`` makes.

Command line (the plugin loads without cuDNN or the CUDA runtime with
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``; ``CUDA_VISIBLE_DEVICES=-1`` keeps it off a GPU)::

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 CUDA_VISIBLE_DEVICES=-1 \\
        python -m glm5_dsa_jax.tools.gpu_compile.step [--impl pallas|xla] [--batch 1] \\
        [--context 4096] [--queries 1] [--hlo FILE] [--json]

Invariants:

* ``entry_ops`` counts every instruction of the entry computation whose opcode is in
  ``KINDS``, tuple-shaped ones included (a regex on ``= shape opcode(`` with one token for
  the shape missed the multi-output fusions and the Pallas calls with several outputs).
* ``weight_sized`` names every entry fusion or copy that reads a product's weight (an entry
  parameter whose path is in ``layout.contraction_orders``) and writes an output of half
  its elements or more: a materialised float32 / bf16 copy of the weight, or a
  multiply written out before its reduce. A product read at HBM speed has none.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P, use_abstract_mesh

import pallas_kernels as pk
from glm5_dsa_jax.cache.contiguous import init_cache
from glm5_dsa_jax.decode import make_step
from glm5_dsa_jax.model.config import DsaConfig
from glm5_dsa_jax.model.layer import DsaAttention
from glm5_dsa_jax.model.layout import contraction_orders
from glm5_dsa_jax.tools.gpu_compile.targets import TARGETS

__all__ = ["H200", "KINDS", "compile_step", "entry_ops", "launched", "summary", "weight_sized",
           "weight_params", "weight_readers"]

#: An H200 as XLA's GPU compiler sees it: the H100's SM (``TARGETS["sm_90"]``) with the
#: H200's memory (4.8 TB/s, 141 GB).
H200 = dataclasses.replace(TARGETS["sm_90"], name="h200", device="NVIDIA H200",
                           memory_bandwidth=4_800_000_000_000, memory_bytes=150_000_000_000)

#: The kernels and control ops of a step.
KINDS = ("fusion", "custom-call", "copy", "conditional", "while")

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*?)\)(?:, |$)", re.M)
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of each array of an HLO shape (a tuple's elements)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def entry(text: str) -> str:
    """The entry computation of an optimized HLO module's text."""
    return text[text.rfind("ENTRY"):]


def entry_ops(text: str) -> list[tuple[str, str, str]]:
    """``(name, opcode, shape)`` of each instruction of the entry computation whose opcode is
    in ``KINDS``, in program order."""
    return [(name, op, shape) for name, shape, op, _ in _INSTR.findall(entry(text)) if op in KINDS]


def _weight_path(name: str) -> str | None:
    """The ``"/"``-joined layout path of a product's weight whose entry parameter jax named
    ``name`` (from the flattened ``params`` argument), or None."""
    flat = re.sub(r"_+", "_", name.split(".")[0])
    for path in contraction_orders():
        if flat == "params_" + "_".join(path) + "_value":
            return "/".join(path)
    return None


def weight_params(text: str) -> dict[str, int]:
    """``{entry parameter name: elements}`` of the products' weights (``layout``'s
    ``contraction_orders`` paths, as jax names the flattened ``params`` argument)."""
    return {name: math.prod(_arrays(shape)[0][1]) for name, shape, op, _ in _INSTR.findall(entry(text))
            if op == "parameter" and _weight_path(name) is not None}


def weight_readers(text: str) -> dict[str, int]:
    """``{weight path: entry kernels and control ops (KINDS) that read it}`` of every
    product's weight that is an entry parameter (a joined group's members after its first
    are none: the step reads its one copy through the first, ``cpu_policy``)."""
    views = _views(text, weight_params(text))
    out = {_weight_path(name): 0 for name in views}
    for _, _, op, args in _INSTR.findall(entry(text)):
        if op in KINDS:
            for name, v in views.items():
                out[_weight_path(name)] += _reads(args, v)
    return out


def weight_sized(text: str) -> list[str]:
    """The entry fusions and copies that read a product's weight and write half its
    elements or more (module doc), as ``"name shape (reads weight)"``."""
    weights = weight_params(text)
    views = _views(text, weights)
    bad = []
    for name, shape, op, args in _INSTR.findall(entry(text)):
        if op not in ("fusion", "copy"):
            continue
        for w, n in weights.items():
            if _reads(args, views[w]) and any(math.prod(dims) * 2 >= n for _, dims in _arrays(shape)):
                bad.append(f"{name} {shape} ({w})")
    return bad


_VIEW = re.compile(r"^\s*%(\S+) = .*? (bitcast|tuple|get-tuple-element)\((.*?)\)(?:, index=(\d+))?", re.M)


def _views(text: str, names) -> dict[str, set[str]]:
    """``{name: the name and each entry view of it}``: a bitcast of a view, and a tuple's
    element taken back (a tuple and its ``get-tuple-element``, what an optimisation barrier
    becomes) are views, never kernels."""
    views = {n: {n} for n in names}
    tuples = {n: {} for n in names}  # name -> {tuple: positions holding a view}
    for name, op, args, index in _VIEW.findall(entry(text)):
        operands = [a.strip().lstrip("%") for a in args.split(",")]
        for n, v in views.items():
            if op == "bitcast" and operands[0] in v:
                v.add(name)
            elif op == "tuple" and any(a in v for a in operands):
                tuples[n][name] = {i for i, a in enumerate(operands) if a in v}
            elif op == "get-tuple-element" and int(index or -1) in tuples[n].get(operands[0], ()):
                v.add(name)
    return views


def _reads(args: str, names) -> bool:
    return any(re.search(rf"%{re.escape(n)}\b", args) for n in names)


def compile_step(impl: str = "pallas", batch: int = 1, context: int = 4096, queries: int = 1,
                 target=H200):
    """The GLM-5.3-Flash decode (``queries=1``) or prefill step of its first full-indexer
    layer on a bf16 contiguous cache of ``context`` tokens (+ one 64-token margin),
    compiled for ``target``: jax's ``Compiled``."""
    topo = topologies.get_topology_desc(platform="cuda", target_config=target.target_config(),
                                        topology="1x1x1")
    sh = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), P())
    cfg = DsaConfig.glm53_flash()
    idx = next(i for i in cfg.dsa_layers if cfg.has_indexer(i))
    layer = nnx.eval_shape(lambda: DsaAttention(cfg, idx, rngs=nnx.Rngs(0), implementation=impl))
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context + 64, has_indexer=True,
                                                 dtype=jnp.bfloat16))
    step, params = make_step(layer)
    rows = batch * queries
    params = step.compute_params(params, rows)  # what a GPU step reads: contraction-last copies
    put = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree)
    params, cache = put(params), put(cache)
    x = jax.ShapeDtypeStruct((batch, queries, cfg.hidden_size), jnp.bfloat16, sharding=sh)
    m = jax.ShapeDtypeStruct((batch, queries), jnp.bool_, sharding=sh)
    if impl == "xla":
        lowered = step.jitted(cache).trace(params, x, m, cache, None).lower()
    else:  # Pallas' GPU lowering reads the compute capability from an abstract CUDA device
        with use_abstract_mesh(pk.cuda_mesh("h100", (1,), ("x",))):
            lowered = step.jitted(cache).trace(params, x, m, cache, None).lower(
                lowering_platforms=("cuda",))
    return lowered.compile()


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLED = re.compile(r"(?:true_computation|false_computation|body|condition)=%([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")


def _computations(text: str) -> dict[str, str]:
    """``{name: body text}`` of each computation of an HLO module's text."""
    comps, name, lines = {}, None, []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), []
        elif line.startswith("}") and name is not None:
            comps[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return comps


def launched(text: str) -> int:
    """Kernels and control ops one step runs at most, counting into control flow: each
    entry fusion, custom call and copy once; a conditional once plus its largest branch's;
    a loop once plus one trip of its body and condition. Unlike the entry's count it does
    not fall when a conditional's kernels move out of it."""
    comps = _computations(text)

    def count(body: str, seen: tuple) -> int:
        n = 0
        for _, _, op, _ in _INSTR.findall(body):
            if op in ("fusion", "custom-call", "copy"):
                n += 1
        for line in body.splitlines():
            op = re.search(r" (conditional|while)\(", line)
            if not op:
                continue
            called = []
            for a, b in _CALLED.findall(line):
                called += [a] if a else [c.strip().lstrip("%") for c in b.split(",")]
            subs = [count(comps[c], seen + (c,)) for c in called if c in comps and c not in seen]
            n += 1 + (max(subs, default=0) if op.group(1) == "conditional" else sum(subs))
        return n

    return count(entry(text), ())


def summary(text: str) -> dict:
    """Counts per ``KINDS`` in the entry, their total, ``launched``, ``weight_sized``'s list
    and ``weight_readers``, of an HLO text."""
    ops = collections.Counter(op for _, op, _ in entry_ops(text))
    counts = {k: ops[k] for k in KINDS}
    return dict(counts=counts, total=sum(counts.values()),
                without_conditionals=sum(counts.values()) - counts["conditional"],
                launched=launched(text), weight_sized=weight_sized(text), weight_readers=weight_readers(text))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="pallas", choices=["pallas", "xla"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=1)
    ap.add_argument("--hlo", help="write the optimized HLO here")
    ap.add_argument("--list", action="store_true", help="print the entry's kernels, one a line")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    ap.add_argument("--cases", nargs="+", metavar="B,CONTEXT,Q",
                    help="compile several steps in this process, one JSON line each")
    a = ap.parse_args(argv)
    if a.cases:
        for c in a.cases:
            b, ctx, q = (int(v) for v in c.split(","))
            s = summary(compile_step(a.impl, b, ctx, q).as_text())
            print(json.dumps(dict(s, impl=a.impl, batch=b, context=ctx, queries=q)), flush=True)
        return
    text = compile_step(a.impl, a.batch, a.context, a.queries).as_text()
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write(text)
    s = summary(text)
    if a.json:
        print(json.dumps(dict(s, impl=a.impl, batch=a.batch, context=a.context, queries=a.queries)))
        return
    if a.list:
        for name, op, shape in entry_ops(text):
            print(f"{op:12s} {name:45s} {shape}")
    print(f"{a.impl} b{a.batch} ctx{a.context} q{a.queries}: "
          + ", ".join(f"{k} {v}" for k, v in s["counts"].items())
          + f"; kernels and control ops: {s['total']} ({s['without_conditionals']} without conditionals;"
          + f" {s['launched']} counting into control flow)"
          + f"; weight-sized intermediates: {s['weight_sized'] or 'none'}")


if __name__ == "__main__":
    main()
