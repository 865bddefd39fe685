#!/bin/bash
# The GPU checks of issue 23, in one call on a lent CUDA machine (docs/journal.md, "On a
# GPU"). Each step has its own time limit and writes its output under OUTDIR as it goes.
#   bash tools/gpu/check.sh OUTDIR [STEP ...]   (wheels for what the machine lacks in .whl/)
# Steps (default: floor base tests small):
#   floor  the floor's measurement: the training step with sampling at 1,000 nodes with
#          cluster_engine.device_sampling and engine.compile_step, beside the numpy rows
#   base   the same without engine.compile_step
#   tests  the CUDA-only tests (graphed steps equal eager ones, compiled too; each replay
#          draws anew) and the CPU ones beside them
#   small  the floor's measurement at 64 nodes
#   train  capes train's speed on a merged DB (8 sessions): host sampling, the plain path
#          (--no-fast) and the fast path (device-drawn minibatches in the step's CUDA
#          graph), and its tests
#   seeds  the 64-node cluster hour on cuda, seeds 0-7 at once, cluster_engine.device_sampling
#          true against false, paired by seed
#   hours  one simulated hour, seed 0, on cuda: the 64-node cluster with device sampling
#          with and without engine.compile_step, and with numpy sampling; the default
#          game (its flat learner does not compile)
#   compiled-hours  of those, the one with engine.compile_step (its compile time)
#   diag   compiled graphed steps against eager ones on the same draws: the largest
#          weight difference, how far the weights moved, every part compiled
set -u
out=${1:-/tmp/gpu-out}; mkdir -p "$out"; shift
steps=${*:-floor base tests small train}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
bench="python3 benchmarks/bench_cluster_engine.py --part step --device cuda --reps 300 --loss-nodes default"
quiet() { grep -v "^W1\|^I1\|UserWarning: TensorFloat32\|warnings.warn\|_warn_once\|Profiler clears"; }
hour() {     # NAME LIMIT ARGS...: one simulated hour on cuda, its wall and CPU time
    local name=$1 limit=$2; shift 2
    /usr/bin/time -f "cuda hour, $name: %e s wall, %U s user" timeout "$limit" \
        python3 -m capes converge-test --seeds 1 --jobs 1 --quiet --device cuda \
        --json "$out/hour-$name.json" "$@" 2>&1 | quiet | tail -2 | tee -a "$out/hour-times.txt"
}
c="--config configs/cluster-sim.toml"; ds="--set cluster_engine.device_sampling=true"
compiled_hour() { hour cluster-compile 200 $c $ds --set engine.compile_step=true; }
nvidia-smi -L; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
for step in $steps; do case $step in
floor) timeout 180 $bench --device-sampling --compile 2>&1 | quiet | tee "$out/step-1000-compile.txt" ;;
base)  timeout 100 $bench --device-sampling 2>&1 | quiet | tee "$out/step-1000.txt" ;;
tests) timeout 180 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/test_cuda_graph.py \
           tests/test_device_replay.py tests/test_qnet_step.py 2>&1 | quiet > "$out/tests.txt"; tail -25 "$out/tests.txt" ;;
train) timeout 240 python3 benchmarks/bench_train_offline.py --device cuda --json "$out/train-offline.json" 2>&1 | quiet | tee "$out/train-offline.txt"
       timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/test_train_fast_path.py 2>&1 | quiet | tail -5 | tee -a "$out/train-offline.txt" ;;
small) timeout 110 $bench --step-nodes 64 --device-sampling --compile 2>&1 | quiet | tee "$out/step-64-compile.txt" ;;
hours)
    compiled_hour
    hour cluster-no-compile 120 $c $ds --set engine.compile_step=false
    hour cluster-numpy-sampling 120 $c --set engine.compile_step=false --set cluster_engine.device_sampling=false
    hour game 120 --noise 10% ;;
compiled-hours) compiled_hour ;;    # that hour alone (its compile time)
seeds)     # the 64-node cluster hour, seeds 0-7, device against numpy sampling (paired)
    rm -rf /tmp/seeds; mkdir -p /tmp/seeds
    for ds in true false; do for k in 0 1 2 3 4 5 6 7; do
        timeout 200 python3 -m capes converge-test --config configs/cluster-sim.toml \
            --seeds 1 --first-seed $k --jobs 1 --quiet --device cuda \
            --set cluster_engine.device_sampling=$ds --json /tmp/seeds/$ds-$k.json >/dev/null 2>&1 &
    done; done; wait
    python3 tools/gpu/paired_seeds.py /tmp/seeds "$out/seeds.json" | tee "$out/seeds.txt" ;;
diag)  timeout 150 python3 tools/gpu/compiled_vs_eager.py 2>&1 | quiet | tail -8 | tee "$out/diag.txt" ;;
*) echo "unknown step $step" ;;
esac; done
