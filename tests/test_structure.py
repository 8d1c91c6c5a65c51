"""The package's shape: imports point one way, modules stay small, each fact has one home.

What issue 9 asked of the structure, checked on the source text (no import is executed):

* No import cycle among the modules of ``glm5_dsa_jax`` and ``pallas_kernels``, counting
  every import statement, at module level or inside a function (a function-level import
  hides a cycle from Python, not from a reader).
* Imports point one way through the layers below (config_json -> config, rope -> layout -> kernels -> placement
  / ops -> cache -> the calls -> execution -> layer -> plan / sharding -> decode -> checkpoint
  -> tools -> cli):
  a module imports only from its own layer or the ones before it.
* No module over 800 lines (``MAX_LINES``): a module holds a concern whole.
* No module defines a function or class of its own name (the package's re-export would
  shadow the module).
* Imports at the top of the module: a function-level import is allowed only where it is
  lazy on purpose, listed with its reason in ``LAZY_IMPORTS`` (and an entry no longer
  needed fails too, so the list stays true).
* No module imports another's private name (``from x import _y``), and ``glm5_dsa_jax``
  does not reach into ``pallas_kernels``' private modules: what crosses a module is its
  API and is spelled so.
* The HF name ``kv_a_proj_with_mqa`` written in at most two modules of ``glm5_dsa_jax``
  (the layout table and at most one doc): every other module reads names from the table.
* The kernel package's seams (issue 22): no module of ``pallas_kernels`` imports a name
  from a kernel module (one that launches a Pallas kernel: the Triton ``pallas_call`` or
  the Mosaic ``plmgpu.kernel``) but a wrapper from its own step's kernel modules, to
  dispatch to them (``KERNEL_DISPATCH``); so no Triton module imports a Mosaic one for a
  helper, nor any kernel module another's. What kernels share lives in private modules
  (``_common``, ``_mosaic``, ``_dtypes``, ``_order_key``), which import no public module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("glm5_dsa_jax", "pallas_kernels")
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the two packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_pkg = MODULES[module].name == "__init__.py"
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> set[str]:
    """Modules of the two packages that ``module`` imports anywhere in its text.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg`` itself (a name its ``__init__`` defines). The implicit import of a parent
    package's ``__init__`` is not an edge: Python runs it first, once, whoever asks.
    """
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(module, node)
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names]
        else:
            continue
        for t in targets:
            # `import pkg.sub.mod` names pkg.sub.mod; keep the longest known module prefix.
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != module:
                out.add(t)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


#: The layers, first to last; a module belongs to the first entry that names it or a
#: package above it. Package ``__init__`` modules that re-export sit with their contents.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("glm5_dsa_jax.model.config_json",),  # HF config.json spellings
    ("glm5_dsa_jax.model.config", "glm5_dsa_jax.model.rope", "glm5_dsa_jax.model.remat", "glm5_dsa_jax.quant",
     "glm5_dsa_jax.model.chunk_rows",
     "glm5_dsa_jax.cpu_policy",
     "glm5_dsa_jax.cli.args", "glm5_dsa_jax.checkpoint.safetensors_file",
     "glm5_dsa_jax.tools.gpu_compile.targets", "glm5_dsa_jax.tools.gpu_compile.ptxas", "pallas_kernels._common",
     "pallas_kernels._hardware_runs"),
    # the tensor table and the parameters it makes; input checks
    ("glm5_dsa_jax.model.layout", "glm5_dsa_jax.model.inputs"),
    ("glm5_dsa_jax.model.weights", "pallas_kernels"),  # HF <-> params from the table; the kernels
    # where a placed layer's arrays live; layer math; fp8 rows; the cache interface
    ("glm5_dsa_jax.parallel.placement", "glm5_dsa_jax.model.ops", "glm5_dsa_jax.cache.fp8",
     "glm5_dsa_jax.cache.interface"),
    ("glm5_dsa_jax.cache.eager",),  # an eager cache operation as one program, placed
    ("glm5_dsa_jax.cache.pages",),  # page bookkeeping
    ("glm5_dsa_jax.cache.rollback",),  # drafts taken back
    ("glm5_dsa_jax.cache.fork",),  # shared prefixes (a paged row started as another's first tokens)
    ("glm5_dsa_jax.cache.contiguous",),
    ("glm5_dsa_jax.cache.transfer",),  # a paged sequence out of one cache and into another
    ("glm5_dsa_jax.cache.paged",),
    ("glm5_dsa_jax.cache",),  # re-exports the caches
    # the attention mass per pool; the indexer loss (its definition, the parameter filters)
    ("glm5_dsa_jax.model.attention_mass", "glm5_dsa_jax.model.indexer_loss"),
    # context parallelism's pipeline; the one execution of a call (takes the layer, imports none)
    ("glm5_dsa_jax.parallel.context", "glm5_dsa_jax.parallel.context_paged", "glm5_dsa_jax.parallel.execution"),  # the one execution of a call (takes the layer, imports none)
    ("glm5_dsa_jax.model.layer", "glm5_dsa_jax.model"),  # the layer (``model/__init__`` imports nothing)
    # the TP plan; shard_layer (the parallel package's __init__ imports nothing)
    ("glm5_dsa_jax.parallel",),
    ("glm5_dsa_jax.decode",),
    ("glm5_dsa_jax.checkpoint",),
    # the tools behind the CLI (bench, demo, roofline, memory_plan, cache_accuracy, gpu_compile)
    ("glm5_dsa_jax.tools",),
    # the command line (and gpu_compile's ``python -m`` alias of its subcommand); the package's public face
    ("glm5_dsa_jax.cli", "glm5_dsa_jax.tools.gpu_compile.__main__", "glm5_dsa_jax"),
)


def layer_of(module: str) -> int:
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > best[1]):
                best = (i, len(n))
    assert best is not None, f"{module} is in no layer of tests/test_structure.py: add it"
    return best[0]


def test_imports_point_one_way():
    wrong = [
        f"{m} (layer {layer_of(m)}) imports {n} (layer {layer_of(n)})"
        for m in MODULES for n in sorted(imports_of(m)) if layer_of(n) > layer_of(m)
    ]
    assert not wrong, "\n".join(wrong)


def test_cycle_finder_finds_a_cycle():
    # The checker itself: a planted cycle through a function-level import is found.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    src = "def f():\n    from glm5_dsa_jax.model.layer import DsaAttention\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


def test_no_import_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_at_most_max_lines(module):
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)} has {n} lines (> {MAX_LINES})"


def test_hf_layout_written_once():
    holders = sorted(
        str(p.relative_to(ROOT)) for m, p in MODULES.items()
        if m.startswith("glm5_dsa_jax") and "kv_a_proj_with_mqa" in p.read_text()
    )
    assert len(holders) <= 2, f"the HF name kv_a_proj_with_mqa is written in {holders}"


def public_names(module: str) -> set[str]:
    """Functions and classes ``module`` defines at its top level."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_shares_its_modules_name(module):
    # `from pkg import name` must not be ambiguous between a module and a function: a package
    # that re-exports a function of its module's name shadows the module (tests then need
    # importlib to reach it).
    leaf = module.rpartition(".")[2]
    assert leaf not in public_names(module), f"{MODULES[module].relative_to(ROOT)} defines {leaf}"


def test_public_names_finds_what_the_rule_would_catch():
    # Had streaming_selection kept its old name (streaming_topk), the rule above would fail.
    assert "streaming_topk" in public_names("pallas_kernels.streaming_selection")


#: Function-level imports that are lazy on purpose: (module, imported module) -> why.
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("glm5_dsa_jax.checkpoint.orbax_io", "orbax.checkpoint"):
        "1-2 s to import; every `import glm5_dsa_jax` would pay it (orbax_io._orbax)",
    ("glm5_dsa_jax.tools.indexer_training", "orbax.checkpoint"):
        "1-2 s to import; every `glm5-dsa` command would pay it (indexer_training._orbax)",
    ("glm5_dsa_jax.tools.gpu_compile.ptxas", "nvidia.cuda_nvcc"):
        "optional (the gpu-compile extra): its absence means ptxas from PATH",
    ("glm5_dsa_jax.tools.bench", "torch"): "the HF baseline: torch is a test extra, absent on Python 3.12",
    ("glm5_dsa_jax.tools.bench", "transformers"): "the HF baseline (with torch)",
    ("glm5_dsa_jax.tools.bench", "transformers.models.glm5_next.configuration_glm5_next"): "the HF baseline",
    ("glm5_dsa_jax.tools.bench", "transformers.models.glm5_next.modeling_glm5_next"): "the HF baseline",
    # Pending: the helper that owns gpu_compile/cases.py moves it to the top; then drop it.
    ("glm5_dsa_jax.tools.gpu_compile.cases", "pallas_kernels.mosaic_attention"): "none (to be moved)",
}


def function_level_imports(module: str, source: str | None = None) -> set[str]:
    """The modules ``module`` (or ``source``, as that module's text) imports inside a function."""
    tree = ast.parse(MODULES[module].read_text() if source is None else source)
    out = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    out.add(_resolve(module, node))
    return out


def test_imports_at_module_level():
    found = {(m, i) for m in MODULES for i in function_level_imports(m)}
    new = sorted(found - set(LAZY_IMPORTS))
    assert not new, ("imports inside a function (move them to the top, or add them to LAZY_IMPORTS "
                     f"with the reason): {new}")
    stale = sorted(set(LAZY_IMPORTS) - found)
    assert not stale, f"LAZY_IMPORTS entries no longer needed (remove them): {stale}"


def test_function_level_imports_finds_them():
    # The checker itself: imports inside a function (nested, relative) are found, a top-level
    # one is not.
    src = ("import re\n"
           "def f():\n    import ctypes\n    def g():\n        from .layout import TENSORS\n")
    assert function_level_imports("glm5_dsa_jax.model.weights", src) == {"ctypes", "glm5_dsa_jax.model.layout"}


def private_imports(module: str) -> list[str]:
    """``from X import _y`` of a private name, or an import of a private module (``_x``)
    of the other package, in ``module``: a name another module needs is part of its
    package's API and says so by its spelling."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(module, node)
            if src.split(".")[0] not in PACKAGES:
                continue
            out += [f"{src}.{a.name}" for a in node.names if a.name.startswith("_")]
            private_module = any(p.startswith("_") and p != "__init__" for p in src.split("."))
            if private_module and src.split(".")[0] != module.split(".")[0]:
                out.append(src)
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_a_module(module):
    assert not private_imports(module), f"{module} imports {private_imports(module)}"


def test_private_import_check_can_fail(tmp_path, monkeypatch):
    planted = tmp_path / "planted.py"
    planted.write_text("from pallas_kernels._common import _planted, eager_jit\n")
    monkeypatch.setitem(MODULES, "glm5_dsa_jax.planted", planted)
    assert private_imports("glm5_dsa_jax.planted") == [
        "pallas_kernels._common._planted", "pallas_kernels._common"]


#: The only imports from a kernel module of ``pallas_kernels`` (one that launches a Pallas
#: kernel) by another module: a step's wrapper and its own step's kernels, which it
#: dispatches to (the entry functions, their block-size dataclasses, and a limit the
#: wrapper's block-size validation checks). A helper that two kernels share belongs in a
#: private module instead.
KERNEL_DISPATCH: dict[tuple[str, str], frozenset[str]] = {
    ("pallas_kernels.scoring", "pallas_kernels.mosaic_scoring"): frozenset(
        {"MosaicIndexScoresBlockSizes", "mosaic_index_scores", "mosaic_index_scores_paged"}),
    ("pallas_kernels.scoring", "pallas_kernels.scoring_backward"): frozenset({"index_scores_backward"}),
    ("pallas_kernels.scoring_backward", "pallas_kernels.mosaic_scoring_backward"): frozenset(
        {"MosaicIndexScoresBackwardBlockSizes", "mosaic_index_scores_backward"}),
    ("pallas_kernels.attention", "pallas_kernels.mosaic_attention"): frozenset(
        {"MosaicSparseMlaBlockSizes", "mosaic_sparse_mla"}),
    ("pallas_kernels.attention", "pallas_kernels.attention_backward"): frozenset(
        {"sparse_mla_backward"}),  # the custom_vjp's backward
    # the dense attention of every visible key runs the sparse kernels over the visible ids
    ("pallas_kernels.causal_attention", "pallas_kernels.attention"): frozenset({"sparse_mla"}),
    ("pallas_kernels.attention_backward", "pallas_kernels.mosaic_attention_backward"): frozenset(
        {"TRANSPOSE_ROWS", "MosaicSparseMlaBackwardBlockSizes", "mosaic_sparse_mla_backward"}),
    ("pallas_kernels.selection", "pallas_kernels.mosaic_selection"): frozenset(
        {"MosaicTopkPoolsBlockSizes", "mosaic_topk_pools"}),
    ("pallas_kernels.selection", "pallas_kernels.radix_select"): frozenset(
        {"one_program_select", "segmented_select", "MAX_COMPARE"}),
}


def is_kernel_module(module: str) -> bool:
    """Whether ``module`` launches a Pallas kernel (Triton or Mosaic GPU) in its text."""
    return bool(re.search(r"\bpallas_call\(|\bplmgpu\.kernel\(", MODULES[module].read_text()))


def kernel_seam_breaks(module: str, source: str | None = None) -> list[str]:
    """The imports of ``module`` (or ``source``, as its text) that cross the kernel
    package's seams: ``imported.name`` for a name from a kernel module not declared in
    ``KERNEL_DISPATCH``, and a private module's import of a public module of the package.
    The package's ``__init__`` (the re-exports) is exempt."""
    if module == "pallas_kernels" or not module.startswith("pallas_kernels."):
        return []
    tree = ast.parse(MODULES[module].read_text() if source is None else source)
    private = module.rpartition(".")[2].startswith("_")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(module, node)
            pairs = [(f"{src}.{a.name}", None) if f"{src}.{a.name}" in MODULES else (src, a.name)
                     for a in node.names]
        else:
            continue
        for target, name in pairs:
            if not target.startswith("pallas_kernels.") or target == module:
                continue
            if private and not target.rpartition(".")[2].startswith("_"):
                out.append(target)
            elif is_kernel_module(target) and name not in KERNEL_DISPATCH.get((module, target), ()):
                out.append(f"{target}.{name}" if name else target)
    return out


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("pallas_kernels")))
def test_kernel_modules_share_helpers_only_through_private_modules(module):
    assert not kernel_seam_breaks(module), (
        f"{module} imports {kernel_seam_breaks(module)} from a kernel module: move a shared "
        "helper to a private module of pallas_kernels, or declare a dispatch in KERNEL_DISPATCH")


def test_kernel_dispatch_is_declared_truly():
    # Every declared import exists and is made: a stale entry would widen the rule.
    for (importer, target), names in KERNEL_DISPATCH.items():
        assert is_kernel_module(target), target
        tree = ast.parse(MODULES[importer].read_text())
        made = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and _resolve(importer, n) == target for a in n.names}
        assert made == names, f"{importer} imports {sorted(made)} from {target}, declared {sorted(names)}"


def test_kernel_seam_check_can_fail():
    # What issue 22 removed: a Triton module taking Mosaic and scoring helpers, a Mosaic
    # module taking the Triton selection's order key, a private module importing a kernel.
    assert kernel_seam_breaks("pallas_kernels.attention", (
        "from pallas_kernels.mosaic_scoring import mosaic_takes\n"
        "from pallas_kernels.mosaic_attention import combine_splits, mosaic_sparse_mla\n"
        "from pallas_kernels.scoring import index_scores\n")) == [
        "pallas_kernels.mosaic_scoring.mosaic_takes", "pallas_kernels.mosaic_attention.combine_splits",
        "pallas_kernels.scoring.index_scores"]
    assert kernel_seam_breaks("pallas_kernels.mosaic_selection", (
        "def f():\n    from pallas_kernels.radix_select import one_program_select\n")) == [
        "pallas_kernels.radix_select.one_program_select"]
    assert kernel_seam_breaks("pallas_kernels._mosaic", "import pallas_kernels.dense_mla\n") == [
        "pallas_kernels.dense_mla"]
    assert kernel_seam_breaks("pallas_kernels.attention", "from pallas_kernels._mosaic import mosaic_takes\n") == []
