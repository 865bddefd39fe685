"""Keep numeric work on one thread per process.

The engine's matrices are small (a 100 × 20 grid, a 32-row minibatch). Threaded BLAS
only adds hand-offs there, and when the cores are busy (two converge-test jobs on two
cores, a daemon beside a storage server) it is ruinous. OpenBLAS's threads spin while
waiting for a core, so a 0.1 ms ``tensordot`` took 12 ms at load 2. Runs that are meant
to use one core call :func:`use_one_core` once, before any work.
"""
from __future__ import annotations

import os
import sys

from threadpoolctl import threadpool_limits


def use_one_core() -> None:
    """One thread for PyTorch's intra-op pool and for every BLAS/OpenMP pool numpy,
    scipy or torch loaded (threadpoolctl sets them for the whole process). Torch is
    not imported for this: a process that has not loaded it yet (the engine imports it
    when its network is first needed) gets ``OMP_NUM_THREADS=1`` and
    ``MKL_NUM_THREADS=1``, which torch reads when it is loaded."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    else:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    threadpool_limits(limits=1)


def torch_threads(n: int) -> None:
    """PyTorch's intra-op pool to ``n`` threads (0: leave PyTorch's default, one per
    core). Why the live engine asks for 1: its networks are small (the per-node model
    has 21,126 weights) and PyTorch's idle pool threads spin for a core; on a 2-core host
    already busy, the per-node train step's median went from 1.31 ms on one thread to
    9.44 ms on two, and the process's CPU time 6.5-fold (docs/engine.md,
    "CPU threads")."""
    if n > 0:
        import torch
        torch.set_num_threads(int(n))


def single_thread_blas() -> None:
    """One thread for numpy's BLAS only (the guide's small matrices), leaving PyTorch's
    pool alone: a daemon training a large model on CPU keeps its cores for that."""
    threadpool_limits(limits=1, user_api="blas")
