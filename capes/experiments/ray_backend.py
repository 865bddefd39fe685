"""An optional Ray backend for converge-test sweeps (issue 11, item 6).

``capes converge-test --jobs J`` runs its runs in a process pool on one machine. For
sweeps of thousands of runs (seed 000 compared methods over 1,000 runs each) the same
runs go to a Ray cluster instead::

    pip install 'capes[ray]'                      # on the driver and on every Ray node
    capes converge-test --config configs/cluster-sim.toml --seeds 1000 \\
        --tuner capes,bo --backend ray --ray-address auto     # an existing cluster
    capes converge-test ... --backend ray --jobs 2            # a local Ray, 2 CPUs

Each run is one Ray task asking for one CPU (the run sets torch to one thread); Ray
schedules, retries and moves the work — nothing here distributes jobs by itself. The
results come back in the order of the plan, so a report is the same whichever backend
ran it (wall times aside). Without ``--ray-address`` (and without ``RAY_ADDRESS`` in the
environment, which ``ray.init`` reads) a local Ray instance is started with ``--jobs``
CPUs and shut down at the end; with one, the driver connects to that cluster, whose
nodes must have CAPES installed (the tasks import it there).

``ray`` is an optional extra: nothing imports it unless this backend is asked for.
:func:`map_jobs` is the one choice between the backends (in this process, a process
pool, Ray) that every sweep makes.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator
from typing import Any

RAY_MISSING = ("--backend ray needs the ray package, which is not installed "
               "(pip install 'capes[ray]')")


def ray_available() -> bool:
    """Whether ``ray`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("ray") is not None


def map_ray(fn: Callable[[Any], Any], jobs: Iterable[Any], address: str | None = None,
            num_cpus: int | None = None) -> Iterator[Any]:
    """``fn(job)`` for every job as Ray tasks of one CPU each; yields the results in the
    jobs' order. ``address``: a Ray cluster (``auto``, ``ray://host:10001``, ...), or
    None for a local instance of ``num_cpus`` CPUs (or the one ``RAY_ADDRESS`` names).
    A Ray started here is shut down when the iterator is finished or closed; one that
    was already initialised (a test's, an application's) is left running."""
    if not ray_available():
        raise RuntimeError(RAY_MISSING)
    import ray
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            kwargs["address"] = address
        elif num_cpus:
            kwargs["num_cpus"] = num_cpus
        ray.init(**kwargs)
        started = True
    try:
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(job) for job in jobs]
        for ref in refs:
            yield ray.get(ref)
    finally:
        if started:
            ray.shutdown()


def map_jobs(fn: Callable[[Any], Any], jobs: list[Any], backend: str = "local",
             workers: int = 1, ray_address: str | None = None) -> Iterator[Any]:
    """``fn(job)`` for every job, the results yielded in the jobs' order (so a report
    is the same whichever backend ran it): ``backend="ray"``, Ray tasks
    (:func:`map_ray`, a local Ray of ``workers`` CPUs or the cluster at
    ``ray_address``); otherwise a pool of ``workers`` processes, or this process, one
    job after another, when ``workers`` is 1."""
    if backend == "ray":
        yield from map_ray(fn, jobs, ray_address, num_cpus=workers)
    elif workers > 1:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=workers) as pool:
            yield from pool.map(fn, jobs)
    else:
        for job in jobs:
            yield fn(job)


__all__ = ["RAY_MISSING", "map_jobs", "map_ray", "ray_available"]
