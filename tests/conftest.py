"""Test setup: 8 virtual CPU devices (set before jax is imported) and float32 defaults."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helper modules by name

# Hypothesis: derandomised by default, so a kernel-vs-reference property test draws the
# same examples on every run and in CI (a bug caught once is caught every time, and a
# failure reproduces locally). Tests that set ``max_examples`` themselves keep their count;
# the rest draw 25. ``HYPOTHESIS_PROFILE=random`` explores new examples locally.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("random", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
