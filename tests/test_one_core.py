"""A converge-test job runs on one thread: numpy's BLAS as well as PyTorch's pool.

Threaded OpenBLAS on the guide's small matrices spun for a busy core: a 0.1 ms product
took 12 ms with two jobs on two cores. The check runs in a child process so that the
limits do not leak into the rest of the suite."""
import subprocess
import sys
import textwrap

import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")

CHILD = textwrap.dedent("""
    import json, numpy, torch
    from threadpoolctl import threadpool_info
    from capes.common.one_core import single_thread_blas, use_one_core
    import sys
    (use_one_core if sys.argv[1] == "all" else single_thread_blas)()
    print(json.dumps({"torch": torch.get_num_threads(),
                      "pools": [(p["user_api"], p["num_threads"]) for p in threadpool_info()]}))
""")


def _child(which: str) -> dict:
    import json
    out = subprocess.run([sys.executable, "-c", CHILD, which], capture_output=True, text=True,
                         check=True, env={"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2",
                                          "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout)


def test_a_run_uses_one_thread_for_torch_and_blas():
    got = _child("all")
    assert got["torch"] == 1
    blas = [n for api, n in got["pools"] if api == "blas"]
    assert blas, "numpy loaded no BLAS pool that threadpoolctl can see"
    assert all(n == 1 for n in blas)


def test_the_daemon_limits_blas_and_leaves_torch_alone():
    got = _child("blas")
    assert got["torch"] == 2          # OMP_NUM_THREADS=2 in the child's environment
    assert all(n == 1 for api, n in got["pools"] if api == "blas")
