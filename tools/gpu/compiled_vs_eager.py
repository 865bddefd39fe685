"""check.sh's ``diag`` step (CUDA only): a per-node engine with device sampling and
``engine.compile_step`` against an eager one (no graph, not compiled), the same 12 steps
from the same CUDA generator state (tests/test_cuda_graph.py's sequence); prints the
largest weight difference, how far the weights moved, which parts failed to compile, and
whether a compiled draw gives the eager draw's ticks and nodes.

    python3 tools/gpu/compiled_vs_eager.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_cuda_graph import _params, _sampling_engine  # noqa: E402  (the tests' engines)
from test_device_replay import feed  # noqa: E402


def main() -> None:
    compiled, eager = _sampling_engine(True, compile_step=True), _sampling_engine(False)
    start = _params(eager.dqn)
    for eng in (compiled, eager):
        torch.cuda.manual_seed(11)
        for _ in range(6):
            eng.train(1)
        for t in range(150, 156):
            feed(eng, t, t + 1, seed=t)
            eng.train(1)
    torch.cuda.synchronize()
    a, b = _params(compiled.dqn), _params(eager.dqn)
    failed = [p.what for p in compiled.compiled_parts if p.failed]
    print(f"parts that failed to compile: {failed or 'none'}")
    print(f"steps {compiled.train_steps} / {eager.train_steps}, graph replays "
          f"{compiled.dqn._graphs.replays}")
    print(f"largest weight difference {float((a - b).abs().max()):.3g}; the eager "
          f"weights moved {float((b - start).abs().max()):.3g} at most")
    for s, eng in ((compiled._sampler, compiled), (eager._sampler, eager)):
        s.prepare(eng.data, 32)
    torch.cuda.manual_seed(5)
    x = eager._sampler.draw(32)
    torch.cuda.manual_seed(5)
    y = compiled._sampler.draw(32)
    print(f"a compiled draw equals the eager one: {all(torch.equal(u, v) for u, v in zip(x, y))}")


if __name__ == "__main__":
    main()
