#!/bin/bash
# The GPU checks of issue 23, in one call on a lent CUDA machine (docs/results.md, "On a
# GPU"): the CUDA-graph step's equality tests, the training-step benchmark at 1,000 nodes
# (both node picks) and 64 nodes, and the torch.compile probe; at 1,000 and 64 nodes and in
# the probe also with cluster_engine.device_sampling (--device-sampling: the minibatch
# drawn on the GPU inside the step's graph, beside the numpy rows of the same run).
#   bash tools/gpu/check.sh OUTDIR [--hours]   (wheels for what the machine lacks in .whl/)
# --hours adds one simulated hour each of the default game and the 64-node cluster on
# cuda and on cpu, and the cluster's on cuda with cluster_engine.device_sampling.
set -u
out=${1:-/tmp/gpu-out}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
bench="python3 benchmarks/bench_cluster_engine.py --part step --device cuda --reps 300"
nvidia-smi -L; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_device_replay.py 2>&1 | tail -3
$bench --device-sampling 2>&1 | tee "$out/step-1000.txt"
$bench --set cluster_engine.node_pick=redraw 2>&1 | tee "$out/step-1000-redraw.txt"
$bench --step-nodes 64 --device-sampling 2>&1 | tee "$out/step-64.txt"
timeout 240 $bench --step-nodes 64 --reps 100 --compile --device-sampling 2>&1 | grep -v "^W1\|^I1" | tee "$out/step-64-compile.txt"
if [ "${2:-}" = "--hours" ]; then
    for dev in cuda cpu; do
        /usr/bin/time -f "$dev hour (default game, seed 0, 10 %%): %e s wall, %U s user" \
            python3 -m capes converge-test --seeds 1 --noise 10% --jobs 1 --device $dev \
            --json "$out/game-$dev.json" --quiet 2>&1 | tail -1
        /usr/bin/time -f "$dev hour (cluster-sim 64 nodes, seed 0): %e s wall, %U s user" \
            python3 -m capes converge-test --config configs/cluster-sim.toml --seeds 1 \
            --jobs 1 --device $dev --json "$out/cluster-$dev.json" --quiet 2>&1 | tail -1
    done
    /usr/bin/time -f "cuda hour (cluster-sim 64 nodes, seed 0, device_sampling): %e s wall, %U s user" \
        python3 -m capes converge-test --config configs/cluster-sim.toml --seeds 1 --jobs 1 \
        --device cuda --set cluster_engine.device_sampling=true \
        --json "$out/cluster-cuda-ds.json" --quiet 2>&1 | tail -1
fi
