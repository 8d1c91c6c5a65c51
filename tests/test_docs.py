"""Every snippet of the docs runs: README.md, docs/*.md and examples/*.py, as printed.

The conventions (docs/development.md "Docs that run" repeats them for writers):

* **A page is a session.** The fenced blocks of one page run top to bottom in one fresh
  Python process, in a fresh temporary directory: a ```` ```python ```` block may use the
  names of the blocks above it (and files they wrote), never those of another page. A
  traceback names the page and its line (each block is compiled with the page as its file
  name, at its own line numbers).
* **Commands.** In ```` ```bash ```` and ```` ```console ```` blocks (``console``: the lines
  starting with ``$ ``; the rest is output, not checked), every ``glm5-dsa ...`` command runs
  at its place in the page as ``python -m glm5_dsa_jax.cli ...`` and must exit 0; in a line
  of commands joined by ``&&`` only the ``glm5-dsa`` ones run (``pip install``, ``pytest``,
  ``jupyter`` never do). Lines ending in ``\\`` continue. Commands show tiny shapes
  (``--preset tiny``) unless the real preset is cheap (``plan``, ``roofline``: arithmetic).
* **Markers**, a comment on the command's line (or a block's first line, for the whole
  block): ``# doc-test: skip (REASON)`` does not run it (sparingly: a GPU, minutes of CPU);
  ``# doc-test: exit N`` expects exit status ``N`` (an error shown on purpose). A marker
  without a reason fails.
* The process has ``PYTHONPATH`` = the repository, ``JAX_PLATFORMS=cpu`` and
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 virtual CPU devices), as a
  reader's snippet would after the README's virtual-device line, and XLA:CPU's LLVM
  optimisation off (as ``tests/conftest.py`` sets it, for compile time); ``examples/*.py``
  run as scripts the same way.

One test per page and per example (pytest-xdist spreads them). ``python tests/test_docs.py
PAGE`` runs one page by hand, printing each block's output.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.py"))
RUN_LANGS = ("python", "bash", "console")
MARKER = re.compile(r"#\s*doc-test:\s*(?P<what>\S+)(?:\s+(?P<arg>.*))?$")
TIMEOUT_S = 600


# ------------------------------------------------------------------------------ parsing
def blocks(text: str) -> list[tuple[str, int, str]]:
    """``(language, first line number of the code, code)`` of every fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise ValueError(f"unclosed ``` block at line {i + 1}")
        out.append((m.group(1), i + 2, "\n".join(lines[i + 1:j])))
        i = j + 1
    return out


def marker(line: str) -> tuple[str, str] | None:
    """``("skip", reason)`` / ``("exit", "N")`` from a ``# doc-test:`` comment, else None;
    ``ValueError`` for a marker that is neither, or a skip without a ``(reason)``."""
    m = MARKER.search(line)
    if not m:
        return None
    what, arg = m.group("what"), (m.group("arg") or "").strip()
    if what == "skip" and re.fullmatch(r"\(.+\)", arg):
        return what, arg
    if what == "exit" and arg.isdigit():
        return what, arg
    raise ValueError(f"bad doc-test marker {line.strip()!r}: expected '# doc-test: skip (REASON)' "
                     "or '# doc-test: exit N'")


def commands(lang: str, code: str, first_line: int) -> list[tuple[int, list[str], int | None]]:
    """``(line, argv after 'glm5-dsa', expected exit status or None = skipped)`` of every
    ``glm5-dsa`` command of a bash or console block."""
    lines = code.splitlines()
    block_marker = marker(lines[0]) if lines and lines[0].lstrip().startswith("#") else None
    out, pending, start = [], "", None
    for k, raw in enumerate(lines):
        line = raw
        if not pending:
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            start = first_line + k
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        cmd, pending = pending, ""
        code_part, _, comment = cmd.partition("#")
        mk = marker("#" + comment) if comment else block_marker
        if mk is None:
            mk = block_marker
        for segment in code_part.split("&&"):
            words = shlex.split(segment)
            if words[:1] != ["glm5-dsa"]:
                continue
            expect = None if mk and mk[0] == "skip" else int(mk[1]) if mk else 0
            out.append((start, words[1:], expect))
    return out


def page_steps(page: str) -> list[tuple[str, int, object]]:
    """The page in order: ``("python", line, code)`` and ``("command", line, (argv,
    expected exit or None))``."""
    steps = []
    for lang, line, code in blocks((ROOT / page).read_text()):
        if lang == "python":
            first = code.splitlines()[0] if code.strip() else ""
            mk = marker(first) if first.lstrip().startswith("#") else None
            if not (mk and mk[0] == "skip"):
                steps.append(("python", line, code))
        elif lang in ("bash", "console"):
            steps += [("command", ln, (argv, expect)) for ln, argv, expect in commands(lang, code, line)]
    return steps


# ------------------------------------------------------------------------------ running
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["JAX_PLATFORMS"] = "cpu"
    # LLVM optimisation off, as tests/conftest.py sets it: compile time, not results.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    return env


def run_page(page: str) -> None:
    """Run ``page``'s steps in this process and the current directory (the driver the test
    starts in a fresh process). Raises on the first failing step."""
    namespace: dict = {"__name__": "__main__"}
    for kind, line, what in page_steps(page):
        if kind == "python":
            print(f"--- {page}:{line} python", flush=True)
            code = compile("\n" * (line - 1) + what, page, "exec")
            exec(code, namespace)
            continue
        argv, expect = what
        shown = "glm5-dsa " + shlex.join(argv)
        if expect is None:
            print(f"--- {page}:{line} skipped: {shown}", flush=True)
            continue
        print(f"--- {page}:{line} $ {shown}", flush=True)
        rc = subprocess.run([sys.executable, "-m", "glm5_dsa_jax.cli", *argv], env=_env()).returncode
        if rc != expect:
            raise SystemExit(f"{page}:{line}: `{shown}` exited {rc}, expected {expect}")


def _run(args: list[str], tmp_path) -> None:
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


# ------------------------------------------------------------------------------ tests
#: The page both CI legs run (the newcomer's page); the others are ``e2e`` (the Python 3.11 leg).
BOTH_LEGS = {"README.md"}


@pytest.mark.parametrize("page", [p if p in BOTH_LEGS else pytest.param(p, marks=pytest.mark.e2e)
                                  for p in PAGES])
def test_page_runs(page, tmp_path):
    """Every python block and glm5-dsa command of the page, in order, in one fresh process."""
    _run([__file__, page], tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(example, tmp_path):
    _run([str(ROOT / example)], tmp_path)


def test_every_page_runs_something():
    """The parser finds what the pages show (so a parser bug cannot make the tests above
    pass by running nothing), and every docs page shows something that runs."""
    assert len(PAGES) >= 9 and EXAMPLES, (PAGES, EXAMPLES)
    for page in PAGES:
        steps = page_steps(page)
        assert steps, f"{page}: no python block or glm5-dsa command to run"
    readme = page_steps("README.md")
    assert ("command", readme[0][1], (["demo"], 0)) in readme  # the fresh-machine demo line


def test_readme_commands_are_the_ci_commands():
    """The README's two fresh-machine commands, exactly; .ci/run runs the second one."""
    text = (ROOT / "README.md").read_text()
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && glm5-dsa demo" in text
    assert 'pip install -e ".[test]" && python -m pytest -q' in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert '"$venv/bin/python" -m pytest -q "$@"' in ci
    # Leg 1 runs it as is but for the Triton compile table (``compile_matrix``), which leg 2 runs.
    assert ci.count("\nrun_leg ") == 3
    assert '\nrun_leg "python3.11 / jax 0.10" python3 .venv "" -m "not compile_matrix"\n' in ci


KERNEL_TESTS = ["test_layer_pallas.py", "test_streaming_topk.py",
                *sorted(p.name for p in (ROOT / "tests").glob("test_kernels_*.py"))]


def test_kernel_tests_run_on_every_jax_leg():
    """Leg 2 (jax 0.11.2) leaves out the tests marked ``slow`` (docs/development.md "CI"); a
    kernel test is never one: Pallas is the API that changes most between jax releases."""
    assert len(KERNEL_TESTS) >= 8, KERNEL_TESTS
    marked = [name for name in KERNEL_TESTS if "mark.slow" in (ROOT / "tests" / name).read_text()]
    assert not marked, f"{marked}: a kernel test marked slow would not run on the jax 0.11.2 leg"
    assert '-m "not e2e and not slow"' in (ROOT / ".ci" / "run").read_text()


def test_parser_and_markers():
    text = "\n".join([
        "```bash", "pip install -e . && glm5-dsa demo", "glm5-dsa plan --tp 2 \\", "    --json",
        "glm5-dsa gpu-compile  # doc-test: skip (needs the gpu-compile extra)",
        "glm5-dsa plan --tp 3  # doc-test: exit 2", "```", "```text", "glm5-dsa not run", "```",
    ])
    (lang, line, code), _ = blocks(text)
    assert commands(lang, code, line) == [
        (2, ["demo"], 0), (3, ["plan", "--tp", "2", "--json"], 0), (5, ["gpu-compile"], None),
        (6, ["plan", "--tp", "3"], 2)]
    assert commands("console", "$ glm5-dsa roofline --gpu h200\noutput glm5-dsa x", 7) == [
        (7, ["roofline", "--gpu", "h200"], 0)]
    with pytest.raises(ValueError, match="doc-test marker"):
        marker("glm5-dsa demo  # doc-test: skip")
    with pytest.raises(ValueError, match="unclosed"):
        blocks("```python\nx = 1\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ.update(_env())
    run_page(sys.argv[1])
