"""Reading a compile's output into ``Report`` rows, and printing them.

Invariants: one ``Report`` per Triton launch of a case on a target (or one for the case's
failure). A kernel passes when it compiled, spills nothing, has no stack frame (local
memory is as slow as a spill), fits the target's shared memory per block, and at least one
block fits an SM; a number that cannot be read (no thunk, no ptxas line) fails it
(``NO-STATS``): a check that has lost its data must not pass.
"""

from __future__ import annotations

import dataclasses
import math
import re

from glm5_dsa_jax.tools.gpu_compile.targets import GpuTarget

__all__ = ["Report", "parse_thunks", "format_table", "failures"]


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


def analyse(target: GpuTarget, rec: dict, compiled: dict, ptxas: str) -> list[Report]:
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
