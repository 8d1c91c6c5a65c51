"""The package's shape: imports point one way, modules stay small, each fact has one home.

What issue 9 asked of the structure, checked on the source text (no import is executed):

* No import cycle among the modules of ``glm5_dsa_jax`` and ``pallas_kernels``, counting
  every import statement, at module level or inside a function (a function-level import
  hides a cycle from Python, not from a reader).
* Imports point one way through the layers below (config_json -> config, rope -> layout -> kernels -> parallel
  execution -> cache -> layer -> plan / placement -> decode -> checkpoint -> tools -> cli):
  a module imports only from its own layer or the ones before it.
* No module over 500 lines.
* No module defines a function or class of its own name (the package's re-export would
  shadow the module).
* The HF name ``kv_a_proj_with_mqa`` written in at most two modules of ``glm5_dsa_jax``
  (the layout table and at most one doc): every other module reads names from the table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("glm5_dsa_jax", "pallas_kernels")
MAX_LINES = 500


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
    ("glm5_dsa_jax.config_json", "glm5_dsa_jax.steps"),  # HF config.json spellings; step names
    ("glm5_dsa_jax.config", "glm5_dsa_jax.rope", "glm5_dsa_jax.quant", "glm5_dsa_jax.float32_copies",
     "glm5_dsa_jax.cli.args", "glm5_dsa_jax.checkpoint.safetensors_file",
     "glm5_dsa_jax.gpu_compile.targets", "glm5_dsa_jax.gpu_compile.ptxas", "pallas_kernels._common"),
    ("glm5_dsa_jax.layout", "glm5_dsa_jax.inputs"),  # the tensor table; input checks
    ("glm5_dsa_jax.weights", "pallas_kernels"),  # HF <-> params from the table; the kernels
    ("glm5_dsa_jax.parallel", "glm5_dsa_jax.ops", "glm5_dsa_jax.fp8"),  # how a step runs on a mesh; layer math; fp8 rows
    ("glm5_dsa_jax.param_init", "glm5_dsa_jax.pages"),  # parameters from the table; page bookkeeping
    ("glm5_dsa_jax.indexer",),  # the indexer's parameters and projections
    ("glm5_dsa_jax.cache",),
    ("glm5_dsa_jax.paged_cache",),
    ("glm5_dsa_jax.paged_step", "glm5_dsa_jax.contiguous_step"),  # the calls (take the layer, import none)
    ("glm5_dsa_jax.data_parallel",),  # the data-parallel call (takes the layer, imports none)
    ("glm5_dsa_jax.layer",),
    ("glm5_dsa_jax.plan", "glm5_dsa_jax.sharding"),  # the TP plan; placement
    ("glm5_dsa_jax.memory_plan",),  # per-device weights and caches (reads the caches' shapes)
    ("glm5_dsa_jax.decode",),
    ("glm5_dsa_jax.checkpoint",),
    ("glm5_dsa_jax.bench", "glm5_dsa_jax.demo", "glm5_dsa_jax.roofline", "glm5_dsa_jax.gpu_compile",
     "glm5_dsa_jax.cache_accuracy"),
    ("glm5_dsa_jax.cli", "glm5_dsa_jax"),  # the command line; the package's public face
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
    src = "def f():\n    from glm5_dsa_jax.layer import DsaAttention\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


def test_no_import_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_at_most_500_lines(module):
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
