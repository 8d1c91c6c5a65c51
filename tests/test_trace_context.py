"""A kernel's first interpret-mode call does not make jitted functions trace again.

jax 0.12 imports its Pallas fuser lazily inside the first interpret-mode ``pallas_call``,
and that import registers a config option that is part of every trace's cache key: a
decode step jitted before that call was traced a second time after it
(``tests/test_paged.py`` saw ``step.traces == 3`` when run alone). ``pallas_kernels``
imports the fuser up front (``pallas_kernels._common``); this runs the sequence in a fresh
process, where nothing else has loaded it first.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import jax, jax.numpy as jnp
import pallas_kernels as pk
traces = []
@jax.jit
def step(x):
    traces.append(1)
    return x + 1
step(jnp.float32(1))
k = jnp.ones((1, 8, 16), jnp.float32)
pk.kpool_compress(k, jnp.zeros((1, 8, 16), jnp.float32), jnp.ones((1, 8), bool),
                  jnp.zeros((4, 16), jnp.float32), implementation="pallas_interpret")
step(jnp.float32(2))
print(len(traces))
"""


def test_first_interpret_call_retraces_nothing():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "1", proc.stdout
