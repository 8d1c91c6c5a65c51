"""``"auto"`` runs a Mosaic GPU kernel only where it has run right on hardware.

* The resolution follows ``pallas_kernels._hardware_runs``: on an (abstract) H100, a
  wrapper's ``"auto"`` is ``"mosaic"`` exactly when every kernel it needs (forward and
  backward) has a record on sm90 whose fingerprint is its code's today; a layer needs
  every Mosaic kernel; an A100 and a CPU never get Mosaic. Checked on a patched record
  (each case of the rule) and on the real one (the lowered program holds a Mosaic kernel
  exactly where the record says).
* The fingerprint ignores comments, docstrings and blank lines, and changes with the
  code: an edited kernel drops out of ``"auto"`` until it runs on hardware again.
* docs/kernels.md's table is ``hardware_table()`` of the record (one home: the code).
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
import pallas_kernels._hardware_runs as hr
from pallas_kernels._common import MOSAIC_MIN_JAX, cuda_lowering, jax_version, lower_for_cuda

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def _record(*kernels, source=None):
    return {(k, "mosaic", "sm90"): hr.HardwareRun("NVIDIA H200", "0.11.2", "2026-12-04",
                                                  source or hr.source_fingerprint(k, "mosaic"))
            for k in kernels}


def _auto(kernel=None, gpu="h100"):
    with cuda_lowering(gpu):
        return pk.resolve_implementation("auto", kernel)


@pytest.mark.lowering
def test_auto_follows_the_record(monkeypatch):
    monkeypatch.setattr(hr, "HARDWARE_RUNS", {})
    assert _auto("topk_pools") == _auto("sparse_mla") == _auto() == "pallas"  # nothing proven
    assert pk.resolve_implementation("auto", "topk_pools") == "xla"  # the CPU host

    monkeypatch.setattr(hr, "HARDWARE_RUNS", _record("topk_pools", "sparse_mla"))
    assert _auto("topk_pools") == "mosaic"
    assert _auto("sparse_mla") == "pallas"  # its backward has not run on hardware
    assert _auto() == "pallas"  # a layer needs every Mosaic kernel
    assert _auto("topk_pools", gpu="a100") == "pallas"  # proven on sm90 only

    monkeypatch.setattr(hr, "HARDWARE_RUNS", _record(*{k for n in hr.AUTO_NEEDS.values() for k in n}))
    assert _auto() == _auto("sparse_mla") == _auto("index_scores_paged") == "mosaic"

    stale = _record("topk_pools", source="000000000000")  # ran, but the code changed since
    monkeypatch.setattr(hr, "HARDWARE_RUNS", stale)
    assert _auto("topk_pools") == "pallas"
    assert hr.proven("topk_pools", "mosaic", "sm90") is None


@pytest.mark.mosaic
@pytest.mark.skipif(jax_version() < MOSAIC_MIN_JAX, reason=f"Mosaic GPU needs jax >= {MOSAIC_MIN_JAX}")
def test_lowered_auto_program_runs_mosaic_exactly_where_proven():
    """On the real record: ``topk_pools(implementation="auto")`` lowered for an H100 holds
    the Mosaic kernel iff it is proven, the Triton one otherwise; on an A100 never."""
    fn = lambda s: pk.topk_pools(s, 16, implementation="auto")  # noqa: E731
    aval = jax.ShapeDtypeStruct((1, 1, 256), jnp.float32)
    text = lower_for_cuda(fn, aval, gpu="h100").as_text()
    want = hr.auto_picks_mosaic("topk_pools", "sm90")
    assert ("mosaic_gpu" in text) == want and ("triton" in text) == (not want)
    assert "mosaic_gpu" not in lower_for_cuda(fn, aval, gpu="a100").as_text()


def test_fingerprint_ignores_comments_and_docstrings(tmp_path):
    code = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    same = '"""Module doc."""\n\n# a comment\ndef f(x):\n    """Other doc,\n    two lines."""\n\n    return x + 1\n'
    other = 'def f(x):\n    """Doc."""\n    return x + 2  # one\n'
    texts = {}
    for name, text in {"code": code, "same": same, "other": other}.items():
        (tmp_path / f"{name}.py").write_text(text)
        texts[name] = hr._code_of(tmp_path / f"{name}.py")
    assert texts["code"] == texts["same"] != texts["other"]


def test_every_kernel_module_exists_and_every_record_names_one():
    here = pathlib.Path(pk.__file__).parent
    for modules in hr.KERNEL_SOURCES.values():
        assert all((here / f"{m}.py").exists() for m in modules)
    for kernel, impl, dev in hr.HARDWARE_RUNS:
        assert (kernel, impl) in hr.KERNEL_SOURCES and dev in ("sm80", "sm90", "sm100")
    assert {k for needs in hr.AUTO_NEEDS.values() for k in needs} == {
        k for k, i in hr.KERNEL_SOURCES if i == "mosaic"}
    for run in hr.HARDWARE_RUNS.values():
        assert dataclasses.asdict(run).keys() == {"gpu", "jax", "date", "source"}


def test_docs_table_is_the_record():
    text = DOCS.read_text()
    assert hr.hardware_table("sm90") in text, (
        "docs/kernels.md's hardware table differs from pk."
        "hardware_table('sm90'); paste it:\n" + hr.hardware_table("sm90"))
