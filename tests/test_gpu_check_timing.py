"""``scripts/gpu_check.py``'s in-loop timing (``in_loop``): ``n`` calls of a function in one
jitted program, each a real call. XLA hoists a loop-invariant call out of a plain
``fori_loop`` (the loop would then time nothing); ``in_loop`` passes the arguments through
an ``optimization_barrier`` chained from call to call, unrolled, and returns every
output, so every call stays."""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import gpu_check  # noqa: E402


def _computations(hlo: str) -> dict[str, str]:
    """Name -> body text of each computation of an HLO module's text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\n%?([\w.\-]+) \([^\n]*\{\n(.*?)\n\}", hlo, re.S)}


def _in_while_body(hlo: str, op: str) -> bool:
    """Whether ``op`` runs in the body of the module's while loop (directly or through the
    computations the body calls)."""
    comps = _computations(hlo)
    body = re.search(r"while\([^\n]*body=%?([\w.\-]+)", hlo).group(1)
    seen, todo = set(), [body]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        if f" {op}(" in comps[name]:
            return True
        todo += re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", comps[name])
    return False


def test_in_loop_keeps_every_call():
    x = jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32)
    f = lambda v: jnp.sin(v) * 3.0  # noqa: E731
    looped = gpu_check.in_loop(f, 4)
    np.testing.assert_array_equal(np.asarray(looped(x)[-1]), np.asarray(f(x)))
    hlo = looped.lower(x).compile().as_text()
    assert "while" not in hlo
    if gpu_check.jax_version() >= gpu_check.IN_LOOP_MIN_JAX:  # jax 0.10's XLA drops the barriers
        assert hlo.count(" sine(") == 4  # unrolled: four calls, none merged
    assert gpu_check.loop_time(f, (x,), 4, 2) >= 0.0

    # Without the barrier XLA hoists the call: the check above can fail.
    plain = jax.jit(lambda v: jax.lax.fori_loop(0, 4, lambda i, c: f(v), jnp.zeros_like(v)))
    assert not _in_while_body(plain.lower(x).compile().as_text(), "sine")
