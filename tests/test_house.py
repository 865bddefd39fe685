"""The house rules a user and a plug-in author rely on: validating a config never
imports torch; every command checks the whole file before it starts anything; a
reward type registered from outside the package plugs into the converge test."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capes.experiments.converge_test import load_config, run_one
from drl_engine.rewards import reward_type

ROOT = Path(__file__).resolve().parent.parent


def test_validating_a_deployment_file_imports_no_torch():
    code = ("import sys, capes.settings, drl_engine.config\n"
            "capes.settings.load_settings(sys.argv[1])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "configs/simulator.toml")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


HEAVY = ("torch", "scipy", "grpc", "zmq", "matplotlib", "optuna")


def _loaded_after(code: str, wanted) -> list[str]:
    """Which modules of ``wanted`` are loaded once ``code`` has run in a fresh
    interpreter."""
    probe = (f"{code}\nimport sys\n"
             f"print(sorted(m for m in {tuple(wanted)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=300, cwd=ROOT)
    return eval(out.stdout.strip().splitlines()[-1])


def test_the_command_line_loads_no_heavy_library_before_a_command_needs_it():
    # `capes --help`, `capes status`, the agents: none of them waits for torch or grpc
    assert _loaded_after("import capes.cli", HEAVY) == []


def _converge_run(ticks: int) -> str:
    return ("from capes.cli import main\n"
            "main(['converge-test', '--seeds', '1', '--set', "
            f"'game.time_limit_ticks={ticks}', '--quiet'])")


def test_a_converge_run_loads_only_what_it_uses():
    # no optional library and not the cluster engine or the baselines, whose imports
    # would only lengthen every start; torch only once the network is needed (the first
    # ticks are the guide's probes), so the first tick does not wait ~2 s for it
    unused = ("scipy", "grpc", "zmq", "matplotlib", "optuna", "drl_engine.node_model",
              "capes.experiments.cluster_test", "capes.experiments.baselines")
    assert _loaded_after(_converge_run(1), ("torch",) + unused) == []
    assert _loaded_after(_converge_run(40), ("torch",) + unused) == ["torch"]  # it trained


# every command that reads a deployment file, with the arguments it needs besides it
COMMANDS = [
    ["interface-daemon"], ["monitor-agent"], ["control-agent"], ["restore-defaults"],
    ["drl-engine"], ["sim-node", "--dir", "{tmp}/sim"], ["demo", "--workdir", "{tmp}/demo"],
    ["converge-test"], ["status"], ["train", "--replay", "{tmp}/none.db", "--out", "{tmp}/m.pt", "--steps", "1"],
]


@pytest.mark.slow
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_every_command_rejects_an_unknown_engine_key_before_starting(tmp_path, argv):
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "configs/simulator.toml").read_text().replace(
        "[engine]", "[engine]\nlearning_rat = 0.1", 1))
    args = [a.format(tmp=tmp_path) for a in argv]
    out = subprocess.run([sys.executable, "-m", "capes", *args, "--config", str(bad)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [f"capes: configuration error: {bad}: engine.learning_rat: unknown key "
                     f"(did you mean learning_rate?)"], out.stderr
    assert not (tmp_path / "demo").exists() and not (tmp_path / "sim").exists()


calls = {"n": 0}


@dataclasses.dataclass
class SignOptions:
    scale: float = 1.0


@reward_type("test_sign_of_diff")
class SignOfDiff:
    """r_t = scale · sign(p_{t+1} − p_t): a reward type a user adds in their own module."""
    Options = SignOptions
    lookback = 1

    def __init__(self, options: SignOptions):
        self.scale = options.scale

    def __call__(self, p: np.ndarray) -> np.ndarray:
        calls["n"] += 1
        r = np.full(len(p), np.nan)
        r[:-1] = self.scale * np.sign(p[1:] - p[:-1])
        return r


def test_a_reward_type_registered_outside_the_package_runs_in_the_converge_test():
    cfg = load_config(None, ['reward.type="test_sign_of_diff"', "reward.options.scale=2.0",
                             "game.time_limit_ticks=120"])
    assert cfg.reward.type == "test_sign_of_diff"
    res = run_one(cfg, seed=0)
    assert res.ticks > 0 and res.train_steps > 0 and calls["n"] > 0
    with pytest.raises(Exception, match="reward.options.scale: test_sign_of_diff: "
                                        "expected a number"):
        load_config(None, ['reward.type="test_sign_of_diff"', 'reward.options.scale="x"'])
