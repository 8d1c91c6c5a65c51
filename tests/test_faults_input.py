"""Bad input to the layer, the cache, the decoder and the CLI: a clear error, nothing changed.

Fixed cases for each rule (cache dtypes, ``prev_topk`` given as a list, with the wrong
shape or dtype, or pointing at future tokens, CLI flags out of range), then property tests
(hypothesis, derandomised by ``conftest.py``) that draw random bad shapes, dtypes, masks and
arguments and assert a ``ValueError`` (``SystemExit(2)`` for the CLI) and that the layer's
parameters, the cache and the decoder's state are exactly as before. Tiny preset, few
examples: the whole file runs in well under a minute on one core.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5_dsa_jax as gd
from glm5_dsa_jax.cli import main
from glm5_dsa_jax.decode import DsaDecoder
from helpers import assert_trees_equal, f32_layer, hidden_states, jitted_call, params_np

CFG = gd.DsaConfig.tiny()
FEW = settings(max_examples=15, deadline=None)


FULL, SHARED = f32_layer(CFG, 1, seed=1), f32_layer(CFG, 2, seed=2)


def _x(b=2, s=6, seed=0):
    return jnp.asarray(hidden_states(CFG, b, s, seed))


# ----------------------------------------------------------------------------- cache
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32, bool, jnp.float64, jnp.complex64,
                                   "not-a-dtype", np.float64])
def test_init_cache_refuses_non_float_dtypes(dtype):
    with pytest.raises(ValueError, match=r"cache dtype .*\['bfloat16', 'float16', 'float32'\]"):
        gd.init_cache(CFG, 1, 8, dtype=dtype)
    with pytest.raises(ValueError, match="cache dtype"):
        FULL.init_cache(1, 8, dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, "float32"])
def test_init_cache_accepts_16_and_32_bit_floats(dtype):
    cache = gd.init_cache(CFG, 1, 8, dtype=dtype)
    assert cache.latent.dtype == jnp.dtype(dtype)


# ----------------------------------------------------------------------------- prev_topk
def _causal_topk(b, s, start=0):
    """A valid prev_topk: each query selects itself and the slot before it."""
    ids = np.full((b, s, CFG.out_width), -1, np.int32)
    for q in range(s):
        ids[:, q, 0] = start + q
        if start + q:
            ids[:, q, 1] = start + q - 1
    return ids


def test_prev_topk_as_list_and_numpy_equals_jax_array():
    x = _x()
    ids = _causal_topk(2, 6)
    want, _ = SHARED(x, prev_topk=jnp.asarray(ids))
    for given_ids in (ids, ids.astype(np.int64), ids.tolist()):
        got, _ = SHARED(x, prev_topk=given_ids)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("bad,needle", [
    ([[1, 2], [3]], "prev_topk must be an integer array"),  # ragged
    (np.zeros((2, 6, CFG.out_width), np.float32), "integer array"),
    (np.zeros((2, 6, 3), np.int32), r"prev_topk must be integer \[B, S, out_width\]"),
    (np.zeros((2, 6), np.int32), r"prev_topk must be integer \[B, S, out_width\]"),
    ("abc", "integer array"),
    (np.full((2, 6, CFG.out_width), 2**40), "outside int32"),
])
def test_prev_topk_bad_shape_or_dtype(bad, needle):
    with pytest.raises(ValueError, match=needle):
        SHARED(_x(), prev_topk=bad)


def test_future_prev_topk_is_refused_eagerly():
    ids = _causal_topk(2, 6)
    ids[1, 2, 3] = 4  # query 2 names slot 4: the future
    with pytest.raises(ValueError, match=r"prev_topk\[1, 2, 3\] = 4 but query 2 sits at slot 2"):
        SHARED(_x(), prev_topk=ids)
    ids = _causal_topk(2, 6)
    ids[0, 0, 5] = -3
    with pytest.raises(ValueError, match="must be -1"):
        SHARED(_x(), prev_topk=ids)
    # A padding query's row is never read: anything there is accepted.
    ids = _causal_topk(2, 6)
    ids[0, 0, 5] = 5
    mask = np.ones((2, 6), bool)
    mask[0, 0] = False
    SHARED(_x(), attention_mask=mask, prev_topk=ids)


def test_future_prev_topk_is_refused_by_the_decoder_with_state_kept():
    dec = DsaDecoder(SHARED, 2, 16)
    dec(_x(s=4), prev_topk=_causal_topk(2, 4))
    cache, length = jax.tree.map(np.asarray, dec.cache), dec.length
    ids = _causal_topk(2, 2, start=4)
    ids[0, 0, 2] = 5  # the next step's query sits at slot 4; 5 is its future
    with pytest.raises(ValueError, match="query 0 sits at slot 4"):
        dec(_x(s=2, seed=1), prev_topk=ids)
    assert dec.length == length
    assert_trees_equal(jax.tree.map(np.asarray, dec.cache), cache)
    dec(_x(s=2, seed=1), prev_topk=_causal_topk(2, 2, start=4))  # the same step, valid
    assert dec.length == length + 2


def test_future_prev_topk_is_masked_under_jit():
    # Inside jit the ids are traced, so they cannot be checked: the layer drops every id
    # past its query's slot, and the output equals the one without those ids.
    run, state = jitted_call(SHARED)
    x = _x()
    ids = _causal_topk(2, 6)
    future = ids.copy()
    future[:, :, 4] = 5  # every query also names slot 5 (the future for queries 0-4)
    future[0, 1, 6] = -7
    out, topk = run(state, x, prev_topk=jnp.asarray(future))
    want, want_topk = run(state, x, prev_topk=jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(out)[:, :5], np.asarray(want)[:, :5])
    t = np.asarray(topk)
    assert (t[:, :5, 4] == -1).all() and (t[:, 5, 4] == 5).all() and t[0, 1, 6] == -1
    # and the last query, for which slot 5 is itself, does read it
    assert not np.allclose(np.asarray(out)[:, 5], np.asarray(want)[:, 5])


# ----------------------------------------------------------------------------- CLI
def _exit_code(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return main(argv), err.getvalue()
        except SystemExit as e:
            return e.code, err.getvalue()


@pytest.mark.parametrize("argv,needle", [
    (["demo", "--steps", "-1"], "--steps: must be a non-negative integer"),
    (["demo", "--prompt", "-3"], "--prompt"),
    (["demo", "--seed", "-1"], "--seed"),
    (["bench", "decode", "--iters", "0"], "--iters: must be a positive integer"),
    (["bench", "decode", "--contexts", "0"], "--contexts"),
    (["bench", "decode", "--contexts", "64,-1"], "--contexts"),
    (["bench", "decode", "--contexts", ","], "--contexts"),
    (["bench", "decode", "--batch", "0"], "--batch"),
    (["bench", "decode", "--contexts", "64", "--cache", "paged", "--capacity", "4200"],
     "multiple of 64 (e.g. 4224)"),
    (["bench", "decode", "--cache", "ring"], "--cache"),
    (["plan", "--elem-bytes", "-2"], "--elem-bytes"),
    (["plan", "--context", "-5"], "--context"),
    (["plan", "--tp", "0"], "--tp"),
    (["plan", "--rank", "-1"], "--rank"),
    (["plan", "--tp", "x"], "expected an integer"),
])
def test_cli_numeric_flags_are_usage_errors(argv, needle):
    code, err = _exit_code(argv)
    assert code == 2 and needle in err


@pytest.mark.slow
def test_demo_steps_zero_is_prefill_only(capsys):
    assert main(["demo", "--steps", "0", "--prompt", "8"]) == 0
    assert "0 steps (prefill only)" in capsys.readouterr().out


def test_demo_too_long_and_shared_only_checkpoint(tmp_path, capsys):
    assert main(["demo", "--steps", "5000"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    gd.save_checkpoint({2: f32_layer(CFG, 2, seed=2)}, tmp_path / "shared_only")
    assert main(["demo", "--checkpoint", str(tmp_path / "shared_only"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds no full-indexer DSA layer" in err and "shared_only" in err


def test_plan_negative_numbers_no_longer_print():
    code, _ = _exit_code(["plan", "--preset", "tiny", "--tp", "2", "--context", "64"])
    assert code == 0


# ----------------------------------------------------------------------------- properties
@st.composite
def bad_layer_call(draw):
    """(hidden, mask, prev_topk, layer) of which at least one is malformed."""
    kind = draw(st.sampled_from(["hidden_shape", "hidden_dtype", "mask_shape", "mask_values",
                                 "mask_dtype", "empty", "prev_shape", "prev_dtype", "prev_future",
                                 "prev_on_full", "no_prev"]))
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    x = hidden_states(CFG, b, s, seed=b * 10 + s)
    mask = np.ones((b, s), bool)
    prev = _causal_topk(b, s)
    layer = SHARED
    if kind == "hidden_shape":
        x = x.reshape(draw(st.sampled_from([(b * s, CFG.hidden_size), (b, s, CFG.hidden_size // 2, 2)])))
        x = x if x.ndim != 3 else x[..., : draw(st.integers(1, CFG.hidden_size - 1))]
    elif kind == "hidden_dtype":
        x = x.astype(draw(st.sampled_from([np.int32, np.bool_, np.uint8])))
    elif kind == "mask_shape":
        mask = np.ones(draw(st.sampled_from([(b, s + 1), (b + 1, s), (s,), (b, s, 1)])), bool)
    elif kind == "mask_values":
        mask = np.ones((b, s), np.int32)
        mask[draw(st.integers(0, b - 1)), draw(st.integers(0, s - 1))] = draw(
            st.sampled_from([2, -1, 7]))
    elif kind == "mask_dtype":
        mask = mask.astype(draw(st.sampled_from([np.float32, np.float16])))
    elif kind == "empty":
        x = x[:, :0] if draw(st.booleans()) else x[:0]
        mask = None
        prev = prev[:, :0] if x.shape[0] else prev[:0]
    elif kind == "prev_shape":
        prev = prev[..., : draw(st.integers(0, CFG.out_width - 1))]
    elif kind == "prev_dtype":
        prev = prev.astype(draw(st.sampled_from([np.float32, np.float64, np.bool_])))
    elif kind == "prev_future":
        q = draw(st.integers(0, s - 1))
        prev[draw(st.integers(0, b - 1)), q, draw(st.integers(0, CFG.out_width - 1))] = draw(
            st.one_of(st.integers(q + 1, q + 50), st.integers(-100, -2)))
    elif kind == "prev_on_full":
        layer = FULL
    elif kind == "no_prev":
        prev = None
    if layer is FULL and kind != "prev_on_full":
        prev = None
    return layer, x, mask, prev


_PARAMS = {1: params_np(FULL), 2: params_np(SHARED)}


@FEW
@given(bad_layer_call(), st.sampled_from(["plain", "cache", "decoder"]))
def test_bad_layer_input_raises_and_changes_nothing(call, how):
    layer, x, mask, prev = call
    if how == "plain":
        with pytest.raises(ValueError):
            layer(x, attention_mask=mask, prev_topk=prev)
    elif how == "cache":
        cache = layer.init_cache(3, 16)
        before = jax.tree.map(np.asarray, cache)
        with pytest.raises(ValueError):
            layer(x, attention_mask=mask, prev_topk=prev, cache=cache)
        assert_trees_equal(jax.tree.map(np.asarray, cache), before)
    else:
        dec = DsaDecoder(layer, max(1, x.shape[0]) if x.ndim == 3 else 1, 16, cache_dtype=jnp.float32)
        before = jax.tree.map(np.asarray, dec.cache)
        with pytest.raises(ValueError):
            dec(x, mask, prev_topk=prev)
        assert dec.length == 0
        assert_trees_equal(jax.tree.map(np.asarray, dec.cache), before)
    assert_trees_equal(params_np(layer), _PARAMS[layer.layer_idx])


@FEW
@given(
    dtype=st.sampled_from([jnp.int8, jnp.uint8, jnp.int16, jnp.int32, jnp.bool_, jnp.float64,
                           jnp.complex64, "int4", "bogus"]),
    batch=st.one_of(st.integers(-3, 0), st.just(True), st.just(2.0), st.integers(1, 3)),
    length=st.one_of(st.integers(-3, 0), st.integers(CFG.max_position_embeddings + 1, 10**7),
                     st.integers(1, 64)),
)
def test_bad_cache_arguments_raise(dtype, batch, length):
    with pytest.raises(ValueError):
        gd.init_cache(CFG, batch, length, dtype=dtype)


# One cache filled once (2 sequences, 8 of 12 slots), and caches made for something else.
_FILLED = FULL(_x(2, 8), cache=FULL.init_cache(2, 12))[2]
_FOREIGN = {
    "batch": FULL.init_cache(3, 12),
    "shared_cache": SHARED.init_cache(2, 12),
    "width": gd.init_cache(gd.DsaConfig.tiny(kv_lora_rank=24), 2, 12, dtype=jnp.float32),
}


@FEW
@given(chunk=st.integers(1, 16), foreign=st.sampled_from(["none", "batch", "shared_cache", "width"]))
def test_chunk_that_does_not_fit_or_foreign_cache_changes_nothing(chunk, foreign):
    if foreign == "none":
        cache, chunk = _FILLED, max(chunk, 5)  # 8 + 5 > 12 slots: does not fit
    else:
        cache = _FOREIGN[foreign]
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError):
        FULL(_x(2, chunk, seed=3), cache=cache)
    assert_trees_equal(jax.tree.map(np.asarray, cache), before)
    assert_trees_equal(params_np(FULL), _PARAMS[1])


_FLAGS = {
    "demo": {"--prompt": "nonneg", "--steps": "nonneg", "--seed": "nonneg"},
    "bench decode": {"--iters": "pos", "--contexts": "poslist", "--batch": "poslist", "--capacity": "pos"},
    "plan": {"--tp": "pos", "--rank": "nonneg", "--elem-bytes": "pos", "--context": "pos", "--dp": "pos",
             "--batch": "pos"},
    "accuracy": {"--contexts": "poslist", "--queries": "pos", "--seed": "nonneg"},
}


@st.composite
def bad_cli(draw):
    cmd = draw(st.sampled_from(sorted(_FLAGS)))
    flag, kind = draw(st.sampled_from(sorted(_FLAGS[cmd].items())))
    lo = 0 if kind == "nonneg" else 1
    bad_int = st.one_of(st.integers(-10**6, lo - 1).map(str), st.sampled_from(["x", "1.5", "", "1e3", "0x10"]))
    if kind == "poslist":
        good = st.integers(1, 99).map(str)
        items = draw(st.lists(st.one_of(good, bad_int), min_size=1, max_size=3))
        if all(i.isdigit() and int(i) >= 1 for i in items):
            items.append(draw(bad_int.filter(lambda v: v != "")))
        value = ",".join(items)
        if all(not v.strip() for v in value.split(",")):
            value = value or ","
    else:
        value = draw(bad_int)
    return cmd.split() + [f"{flag}={value}"]


@FEW
@given(bad_cli())
def test_bad_cli_numbers_exit_2(argv):
    code, err = _exit_code(argv)
    assert code == 2, (argv, err)
    assert err.count("\n") == 1 and "error:" in err, err  # one line, not argparse's usage block


@pytest.mark.slow
def test_future_prev_topk_is_refused_on_a_paged_cache():
    """A shared layer on a paged cache refuses an id past its query's position within the
    query's own sequence, as the contiguous cache does, naming prev_topk, the row and the
    id; nothing is written. The same id is accepted on a row whose sequence is longer."""
    from glm5_dsa_jax.decode import PagedDecoder

    cache = SHARED.init_paged_cache(2, num_pages=4, page_size=8)
    _, _, cache = SHARED(_x(s=5), attention_mask=np.array([[True] * 5, [True] * 3 + [False] * 2]),
                         cache=cache, prev_topk=_causal_topk(2, 5))  # lengths 5 and 3
    ids = np.full((2, 1, CFG.out_width), -1, np.int32)
    ids[:, 0, 0] = 4  # row 0's query is at position 5 (fine), row 1's at 3: 4 is its future
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError, match=r"prev_topk\[1, 0, 0\] = 4 but query 0 sits at slot 3 \(row 1\)"):
        SHARED(_x(s=1, seed=1), cache=cache, prev_topk=ids)
    assert_trees_equal(jax.tree.map(np.asarray, cache), before)
    dec = PagedDecoder(SHARED, 2, num_pages=4, page_size=8)
    dec(_x(s=5), np.array([[True] * 5, [True] * 3 + [False] * 2]), prev_topk=_causal_topk(2, 5))
    with pytest.raises(ValueError, match=r"prev_topk\[1, 0, 0\] = 4 .*\(row 1\)"):
        dec(_x(s=1, seed=1), prev_topk=ids)
    ids[1, 0, 0] = 3  # its own position: accepted
    SHARED(_x(s=1, seed=1), cache=cache, prev_topk=ids)
