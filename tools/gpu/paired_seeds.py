"""check.sh's ``seeds`` step: the cluster hours of DIR (``true-K.json``, ``false-K.json``:
cluster_engine.device_sampling on and off, seed K) paired by seed, and merged into OUT.

    python3 tools/gpu/paired_seeds.py DIR OUT.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from capes.common.stats import paired_mean_ci  # noqa: E402


def main(folder: str, out: str) -> None:
    runs = {}
    for f in sorted(Path(folder).glob("*.json")):
        arm, seed = f.stem.split("-")
        runs[(arm, int(seed))] = json.loads(f.read_text())["runs"][0]
    Path(out).write_text(json.dumps({f"{a}-{s}": r for (a, s), r in runs.items()}))
    device, numpy = [], []
    for seed in sorted({s for _, s in runs}):
        a, b = runs.get(("true", seed)), runs.get(("false", seed))
        if a is None or b is None:
            print(f"seed {seed}: a run is missing")
            continue
        device.append(a["mean_relative"])
        numpy.append(b["mean_relative"])
        print(f"seed {seed}: hour mean device {a['mean_relative']:.4f} numpy "
              f"{b['mean_relative']:.4f}; recover ticks device "
              f"{[p['recover_ticks'] for p in a['per_phase']]} numpy "
              f"{[p['recover_ticks'] for p in b['per_phase']]}")
    ci = paired_mean_ci(numpy, device)            # device − numpy
    if ci is not None:
        print(f"device - numpy, paired over {len(device)} seeds: {ci[0]:+.4f} "
              f"[{ci[1]:+.4f}, {ci[2]:+.4f}] (95 % t)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
