"""Test setup: 8 virtual CPU devices (set before jax is imported) and float32 defaults.

The Hugging Face oracle needs torch. Its CPU build exists on this machine kind for Python
3.11 only, so on an interpreter without torch (the CI leg on Python 3.12 with the newest
jax) the modules that import it are not collected, and the run says so in its header and
summary: those modules then run on the Python 3.11 leg only.

After each test module, jax's in-memory caches (traces, lowerings, compiled executables)
are cleared: a worker runs dozens of modules, each compiling programs no other module
reuses, and without the clear a worker's memory grows to several GiB by the end of the run.
"""

import gc
import importlib.util
import os
import time
from pathlib import Path

# XLA:CPU compiles with LLVM's optimisation off (``--xla_backend_optimization_level=0``): most
# of the suite's time is compiling programs that then run once on tiny shapes, and that flag
# took two layer modules from 183 to 140 seconds (2026-12-06). XLA's HLO passes still run, so a
# test reading the compiled program (its fusions, copies, costs) sees what a default build
# compiles; only the machine code of each fusion is less tuned. The deviceless GPU compile's
# workers drop the flag (``gpu_compile.worker_xla_flags``): under it the Triton kernels' PTX
# keeps its values in local memory, and the compile table would report spills (CI, 2026-12-06).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helper modules by name

# Hypothesis: derandomised by default, so a kernel-vs-reference property test draws the
# same examples on every run and in CI (a bug caught once is caught every time, and a
# failure reproduces locally). Tests that set ``max_examples`` themselves keep their count;
# the rest draw 25. ``HYPOTHESIS_PROFILE=random`` explores new examples locally.
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("random", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAVE_TORCH = importlib.util.find_spec("torch") is not None

# Test modules that import torch (the HF oracle, or safetensors.torch) at module level.
TORCH_MODULES = ["test_checkpoint.py", "test_decode.py", "test_hf_models.py", "test_hf_parity.py",
                 "test_hf_parity_rope.py", "test_paged_hf.py", "test_quant.py", "test_rope.py"]

collect_ignore = [] if HAVE_TORCH else list(TORCH_MODULES)

_LEFT_OUT = (
    f"torch is not installed for this Python: the HF-oracle modules {TORCH_MODULES} are not "
    "collected (they run on the Python 3.11 leg)"
)


@pytest.fixture(scope="module", autouse=True)
def _clear_jax_caches_after_the_module():
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


def pytest_report_header(config):
    return None if HAVE_TORCH else _LEFT_OUT


def pytest_sessionstart(session):
    session.config._glm5_started = time.time()


def pytest_terminal_summary(terminalreporter, config):
    if not HAVE_TORCH:
        terminalreporter.write_line(_LEFT_OUT)
    # A summary table a test wrote in a pytest-xdist worker during this run (the worker's own
    # summary is not shown): tests/test_gpu_compile.py's compile table.
    cache = getattr(config, "cache", None)
    if cache is None or hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("dsession"):
        return
    txt = Path(cache.mkdir("gpu-compile")) / "report.txt"
    if txt.exists() and txt.stat().st_mtime >= getattr(config, "_glm5_started", 0):
        title, _, text = txt.read_text().partition("\n")
        terminalreporter.write_sep("=", title)
        for line in text.splitlines():
            terminalreporter.write_line(line)
