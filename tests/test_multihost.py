"""Many hosts: 2 local processes x 4 CPU devices, joined by ``jax.distributed`` on loopback
into one 8-device mesh, run the sharded prefill and a decode step; the result must equal
the single-process 8-device run (and so, through test_sharding, the unsharded layer).
Data parallelism: 2 processes x 2 CPU devices as the mesh ``("data", "tp") = (2, 2)``, data
across the processes and tp within each, on both cache kinds; each process's rows must
equal the unsharded layer's. Context parallelism: 2 processes x 2 CPU devices as ``("cp",
"tp") = (2, 2)``, each process holding half of every sequence's slots; a chunked prefill,
the cache saved and restored through orbax across the processes, a decode step: equal to
the unsharded layer.

Each process writes every addressable shard of the replicated outputs
(tests/_multihost_worker.py); the test checks all 8 device copies. Top-k rows must be
bit-identical; outputs are compared at 1e-5 (the same float32 tolerance as
test_sharding: the all-reduce across processes may add its partial sums in another order).
The whole run is bounded by a timeout, and it runs on CPU only (gloo collectives).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import F32_REORDER, tiny8

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT_S = 120
DP_TIMEOUT_S = 240  # two caches, four compiled steps per process
NPROC = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(out_dir, mode="tp"):
    env = dict(os.environ)
    # dp, cp: 2 devices a process; LLVM optimisation off as tests/conftest.py has it.
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={4 if mode == 'tp' else 2}"
                        " --xla_backend_optimization_level=0")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    port = free_port()
    procs = []
    for pid in range(NPROC):
        log = open(os.path.join(out_dir, f"proc{pid}.log"), "w")
        procs.append((subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_multihost_worker.py"), str(port), str(pid),
             str(NPROC), str(out_dir), mode],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        ), log))
    return procs


def wait_all(procs, out_dir, timeout_s=TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    try:
        for p, _ in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = []
    for pid, (p, _) in enumerate(procs):
        with open(os.path.join(out_dir, f"proc{pid}.log")) as f:
            logs.append(f"--- process {pid} (exit {p.returncode}) ---\n{f.read()[-4000:]}")
    return [p.returncode for p, _ in procs], "\n".join(logs)


def test_two_processes_one_mesh_equal_single_process(tmp_path):
    procs = start_workers(tmp_path)  # start first: they compile while we compute the reference
    try:
        import _multihost_worker as worker

        assert len(jax.devices()) == 8
        layer, x, mask = worker.build_inputs(tiny8())
        ref = [np.asarray(a) for a in worker.run(layer, jax.make_mesh((8,), ("tp",)), x, mask)]
    finally:
        codes, logs = wait_all(procs, tmp_path)
    assert codes == [0] * NPROC, f"workers failed or timed out after {TIMEOUT_S} s:\n{logs}"
    heads = []
    for pid in range(NPROC):
        got = np.load(tmp_path / f"proc{pid}.npz")
        for name, want in zip(("out", "topk", "out2", "topk2"), ref):
            for k in range(8 // NPROC):
                a = got[f"{name}_{k}"]
                if name.startswith("topk"):
                    np.testing.assert_array_equal(a, want, err_msg=f"process {pid} device {k}")
                else:
                    np.testing.assert_allclose(a, want, atol=F32_REORDER, rtol=F32_REORDER,
                                               err_msg=f"process {pid} device {k}")
        heads += got["q_b_proj_heads"].tolist()
    assert sorted(heads) == list(range(8))  # one head per device, split across processes
    assert (ref[1][2, :7] == -1).all()  # padded rows select nothing


@pytest.mark.slow
def test_data_parallel_across_processes_equals_unsharded(tmp_path):
    procs = start_workers(tmp_path, "dp")
    try:
        import _multihost_worker as worker

        layer, x, mask = worker.build_dp_inputs(tiny8())
        ref = [np.asarray(a) for a in worker.run_dp(layer, None, x, mask)]
    finally:
        codes, logs = wait_all(procs, tmp_path, DP_TIMEOUT_S)
    assert codes == [0] * NPROC, f"workers failed or timed out after {DP_TIMEOUT_S} s:\n{logs}"
    rows = set()
    for pid in range(NPROC):
        got = np.load(tmp_path / f"proc{pid}.npz")
        for name, want in zip(worker.DP_NAMES, ref):
            for k in range(2):  # the process's two tp devices hold the same rows
                a, r = got[f"{name}_{k}"], int(got[f"{name}_{k}_row"])
                assert a.shape[0] == 2
                rows.add(r)
                if "topk" in name:
                    np.testing.assert_array_equal(a, want[r:r + 2], err_msg=f"{name} process {pid}")
                else:
                    np.testing.assert_allclose(a, want[r:r + 2], atol=F32_REORDER, rtol=F32_REORDER,
                                               err_msg=f"{name} process {pid}")
        assert {int(got[f"out_{k}_row"]) for k in range(2)} == {2 * pid}  # process k: data shard k
    assert rows == {0, 2}


CP_TIMEOUT_S = 240  # three compiled steps, an orbax save and restore per process


@pytest.mark.slow
def test_context_parallel_across_processes_equals_unsharded(tmp_path):
    procs = start_workers(tmp_path, "cp")
    try:
        import _multihost_worker as worker

        layer, x, mask = worker.build_cp_inputs(tiny8())
        ref = [np.asarray(a) for a in worker.run_cp(layer, None, x, mask)[0]]
    finally:
        codes, logs = wait_all(procs, tmp_path, CP_TIMEOUT_S)
    assert codes == [0] * NPROC, f"workers failed or timed out after {CP_TIMEOUT_S} s:\n{logs}"
    for pid in range(NPROC):
        got = np.load(tmp_path / f"proc{pid}.npz")
        for name, want in zip(worker.CP_NAMES, ref):
            for k in range(2):
                a = got[f"{name}_{k}"]
                if "topk" in name:
                    np.testing.assert_array_equal(a, want, err_msg=f"{name} process {pid} device {k}")
                else:
                    np.testing.assert_allclose(a, want, atol=F32_REORDER, rtol=F32_REORDER,
                                               err_msg=f"{name} process {pid} device {k}")
            assert got[f"slots_{k}"].tolist() == [16 * pid, 16 * pid + 16]  # process k: cp shard k's slots
    # The decode step selects: fewer tokens than the 30 visible to row 0 (7 pools, select_k 4).
    assert 0 < (ref[5][0, 0] >= 0).sum() < 30
