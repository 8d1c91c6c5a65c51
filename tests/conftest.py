"""Test setup: 8 virtual CPU devices (set before jax is imported) and float32 defaults."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helper modules by name
