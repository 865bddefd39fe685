#!/bin/bash
# The GPU checks of issue 23, in one call on a lent CUDA machine (docs/results.md, "GPU"):
# the CUDA-graph step's equality test, the training-step benchmark at 1,000 and 64 nodes,
# the flat (Table 5.3) step, and one simulated hour each on cuda and on cpu.
#   bash tools/gpu/check.sh OUTDIR    (wheels for what the machine lacks in .whl/, if any)
set -u
out=${1:-/tmp/gpu-out}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py 2>&1 | tail -5
python3 benchmarks/bench_cluster_engine.py --part step --device cuda --reps 300 2>&1 | tee "$out/step-1000.txt"
python3 benchmarks/bench_cluster_engine.py --part step --device cuda --step-nodes 64 --reps 300 2>&1 | tee "$out/step-64.txt"
timeout 120 python3 benchmarks/bench_train_step.py --device cuda --steps 300 2>&1 | tail -8 | tee "$out/flat.txt"
for dev in cuda cpu; do
    /usr/bin/time -f "$dev hour (default game, seed 0, 10 %%): %e s wall, %U s user" \
        python3 -m capes converge-test --seeds 1 --noise 10% --jobs 1 --device $dev \
        --json "$out/game-$dev.json" --quiet 2>&1 | tail -2
done
for dev in cuda cpu; do
    /usr/bin/time -f "$dev hour (cluster-sim 64 nodes, seed 0): %e s wall, %U s user" \
        timeout 150 python3 -m capes converge-test --config configs/cluster-sim.toml --seeds 1 \
        --jobs 1 --device $dev --json "$out/cluster-$dev.json" --quiet 2>&1 | tail -2
done
