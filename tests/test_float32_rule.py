"""``glm5_dsa_jax.tools.float32_rule``: a 16-bit result judged by its distance from float32.

* Another order of rounding passes (its error about bf16 ``"xla"``'s, or under the floor);
  a tensor a few percent off fails, named; over the floor, ``RATIO`` times ``"xla"``'s error
  is the limit.
* A gradient where float32's is exactly zero, a non-finite one, a shape unlike float32's:
  each is an infinite error, and fails an implementation and the baseline alike.
* ``against_float32`` on pytrees (a parameter state's nesting) and the kernel floor.
"""

from __future__ import annotations

import math

import numpy as np

from glm5_dsa_jax.tools import float32_rule as f32r


def _grads(seed=0):
    """A float32 reference and two bf16-like runs of it (noise ~1e-3 of each tensor), one
    tensor exactly zero in all three (as the indexer's under the output loss)."""
    rng = np.random.default_rng(seed)
    ref = {name: rng.standard_normal(shape) for name, shape in
           (("q_a_proj", (8, 6)), ("o_proj", (6, 8)), ("kv_a_layernorm", (6,)))}
    ref["indexer/wk"] = np.zeros((4, 3))
    noisy = lambda: {k: v + 1e-3 * np.linalg.norm(v) / np.sqrt(v.size) * rng.standard_normal(v.shape)  # noqa: E731
                     for k, v in ref.items()}
    return ref, noisy(), noisy()


def test_rule_passes_another_order_of_rounding():
    ref, xla, other = _grads()
    errs_xla = f32r.tensor_errors(xla, ref)
    assert errs_xla["indexer/wk"] == 0.0 and 0 < errs_xla["q_a_proj"] < 3e-3
    ok, check, details = f32r.judge(f32r.tensor_errors(other, ref), errs_xla)
    assert ok and check.startswith("ok"), check
    assert details["worst_limit"] == f32r.GRAD_FLOOR  # errors of ~1e-3: the floor is the limit
    ok, check, _ = f32r.judge(errs_xla, None)  # the baseline itself
    assert ok and check.startswith("ok (bf16 baseline"), check


def test_rule_catches_a_wrong_gradient():
    ref, xla, other = _grads()
    errs_xla = f32r.tensor_errors(xla, ref)
    # One tensor 5 % off (a fault, not rounding): over max(1.5 * xla's error, 1e-2).
    wrong = dict(other, o_proj=other["o_proj"] * 1.05)
    ok, check, details = f32r.judge(f32r.tensor_errors(wrong, ref), errs_xla)
    assert not ok and check.startswith("MISMATCH 1 of 4 tensors: o_proj"), check
    assert details["worst_param"] == "o_proj"
    # Over the floor where xla's own error is large: 1.5 x xla's is the limit then.
    loose = {k: 4e-2 for k in errs_xla}
    assert f32r.judge(dict(loose, o_proj=5.9e-2), loose)[0]
    assert not f32r.judge(dict(loose, o_proj=6.1e-2), loose)[0]
    assert f32r.global_error(xla, ref) < 3e-3 < f32r.global_error(wrong, ref)


def test_zero_pattern_non_finite_and_shape_fail_everyone():
    ref, xla, other = _grads()
    errs_xla = f32r.tensor_errors(xla, ref)
    for bad in (dict(other, **{"indexer/wk": np.full((4, 3), 1e-6)}),  # not zero where float32's is
                dict(other, q_a_proj=np.where(np.eye(8, 6) > 0, np.nan, other["q_a_proj"])),
                dict(other, kv_a_layernorm=np.full((6,), np.inf)),
                dict(other, o_proj=other["o_proj"].T)):  # another shape
        errs = f32r.tensor_errors(bad, ref)
        assert math.inf in errs.values()
        assert not f32r.judge(errs, errs_xla)[0]
        assert not f32r.judge(errs, None)[0]


def test_against_float32_on_pytrees_and_the_kernel_floor():
    """Nested parameter trees are compared leaf by leaf (named by path); the kernel floor
    (2**-8) passes one bf16 rounding of each entry where ``"xla"`` was exact, and fails a
    tenth of one operand's gradient lost."""
    rng = np.random.default_rng(1)
    ref = {"attn": {"wq": rng.standard_normal((16, 8)), "wk": rng.standard_normal((16, 8))}}
    bf16 = lambda t: {"attn": {k: v * (1 + 2.0**-9 * rng.choice([-1, 1], v.shape)) for k, v in t["attn"].items()}}  # noqa: E731
    ok, check, details = f32r.against_float32(bf16(ref), ref, ref, floor=f32r.KERNEL_FLOOR)
    assert ok, check
    assert set(details["errs"]) == {"['attn']['wq']", "['attn']['wk']"}
    assert all(e == 0.0 for e in details["errs_xla"].values())
    lost = {"attn": dict(ref["attn"], wk=ref["attn"]["wk"] * 0.9)}
    ok, check, details = f32r.against_float32(lost, ref, ref, floor=f32r.KERNEL_FLOOR)
    assert not ok and "['attn']['wk']" in check and details["worst_param"] == "['attn']['wk']", check
