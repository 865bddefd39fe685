"""PNG plots of converge-test results (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def recorded_points(values: list) -> tuple[list[int], list[float]]:
    """(ticks, values) of the ticks that recorded one: the loss is recorded every few
    ticks only, and a line through NaN gaps draws nothing at all."""
    xs = [i for i, v in enumerate(values) if v is not None and v == v]
    return xs, [float(values[i]) for i in xs]


def plot_converge(report: dict, path: str | Path) -> None:
    """Top: one traced run per cell (throughput, window, ε, prediction error);
    bottom: success rate and converge times per cell."""
    plt = _pyplot()
    traced = [r for r in report["runs"] if r.get("trace")]
    fig, axes = plt.subplots(5, 1, figsize=(11, 15))
    ax_tp, ax_par, ax_eps, ax_loss, ax_conv = axes
    for run in traced:
        tr = run["trace"]
        label = f"noise {run['noise']:g}, {run['reward']}, seed {run['seed']}"
        ax_tp.plot(tr["true_throughput"], lw=1, label=label)
        ax_par.plot(tr["window"], lw=1, label=f"window m ({label})")
        ax_par.plot(tr["rate_limit"], lw=1, ls="--", label=f"rate limit τ ({label})")
        ax_eps.plot(tr["epsilon"], lw=1, label=label)
        ax_loss.plot(*recorded_points(tr["loss"]), lw=0.6, marker=".", ms=2, label=label)
    ax_tp.set_ylabel("noise-free throughput")
    ax_par.set_ylabel("parameter value")
    ax_eps.set_ylabel("ε")
    ax_loss.set_ylabel("TD loss (prediction error)")
    ax_loss.set_yscale("log")
    for ax in axes[:4]:
        ax.set_xlabel("simulated second")
        if traced:
            ax.legend(fontsize=6, loc="best")
    cells = report["cells"]
    names = [f"{c['noise'] * 100:g}%\n{c['reward']}" for c in cells]
    times = [c["converge_times"] or [float("nan")] for c in cells]
    ax_conv.boxplot(times, tick_labels=names)
    for i, c in enumerate(cells, start=1):
        ci = c.get("median_ci95")
        note = (f"{c['wins']}/{c['runs']} won"
                + (f"\nmedian 95 % CI [{ci[0]:.0f}, {ci[1]:.0f}]" if ci else
                   f"\nn={c['wins']}: too few for a CI" if c["wins"] else ""))
        ax_conv.annotate(note, (i, 0.98), fontsize=7, ha="center", va="top",
                         xycoords=("data", "axes fraction"),
                         bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    ax_conv.set_ylabel("time to first win (simulated s)")
    ax_conv.set_title(f"time to the first win per cell (a win is not convergence; tuner "
                      f"{report.get('tuner', 'capes')}, preset {report['preset']}, "
                      f"{report['seeds_per_cell']} seeds per cell)", fontsize=9, loc="left")
    ax_tp.set_title("one traced run per cell", fontsize=9, loc="left")
    fig.suptitle(f"capes converge-test: {len(cells)} cell(s) × {report['seeds_per_cell']} "
                 f"seed(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
