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


DAEMON = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from threadpoolctl import threadpool_info
    from drl_engine.config import DQNConfig, RewardConfig
    from drl_engine.daemon import EngineDaemonOptions, _start_engine
    db, n = Path(sys.argv[1]), int(sys.argv[2])
    eng = _start_engine(db, DQNConfig(stack=4, exploration_ticks=10),
                        RewardConfig(pis=["tp"]),
                        EngineDaemonOptions(device="cpu", cpu_threads=n),
                        db.parent / "none.pt")
    assert eng is not None
    print(json.dumps({"torch": torch.get_num_threads(),
                      "pools": [(p["user_api"], p["num_threads"]) for p in threadpool_info()]}))
""")


@pytest.mark.parametrize("cpu_threads, torch_threads", [(1, 1), (0, 2)])
def test_the_daemon_runs_blas_and_torch_on_its_cpu_threads(tmp_path, make_session,
                                                          cpu_threads, torch_threads):
    """The live engine's PyTorch pool has ``--cpu-threads`` threads (1 by default: on a
    busy 2-core host the default pool's spinning threads took a train step from 1.3 to
    9.4 ms and the engine's CPU time 6.5-fold, docs/engine.md); 0 leaves PyTorch's own
    (OMP_NUM_THREADS=2 here). BLAS is on one thread either way."""
    import json
    make_session(tmp_path / "a.db", ticks=20)
    out = subprocess.run([sys.executable, "-c", DAEMON, str(tmp_path / "a.db"),
                          str(cpu_threads)], capture_output=True, text=True, check=True,
                         env={"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2",
                              "PATH": "/usr/bin:/bin"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == torch_threads
    assert all(n == 1 for api, n in got["pools"] if api == "blas")
