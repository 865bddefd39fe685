"""The best-known setting's lower bound with the pooled noise floor
(``engine.lcb_pooled_noise``, drl_engine/guide.py): a setting whose samples happen not
to spread is not thereby certain."""
import numpy as np
import pytest

from drl_engine.config import DQNConfig
from drl_engine.guide import Guide
from test_guide import GAME_GRID

CAPPED, NOISY = (4, 10), (4, 60)      # grid indices, 50 window steps apart: no smoothing
CAP, NOISY_SAMPLES = 97.0, (80.0, 120.0, 80.0, 120.0)


def guide(pooled: bool) -> Guide:
    """A capped, noise-free setting (every sample CAP) and a higher, noisy one, four
    samples each."""
    g = Guide(GAME_GRID, DQNConfig(guided=True, lcb_pooled_noise=pooled),
              np.random.default_rng(0))
    for key, samples in ((CAPPED, (CAP,) * len(NOISY_SAMPLES)), (NOISY, NOISY_SAMPLES)):
        for p in samples:
            g.grid_stats[(slice(None),) + key] += (p, p * p, 1.0)
    return g


def bounds(g: Guide, pooled: bool) -> tuple[float, float]:
    """The two settings' bounds by the formula the switch names (their own variance, or
    at least the variance pooled within both)."""
    kappa, n = g.cfg.lcb_kappa, len(NOISY_SAMPLES)
    own = np.var(NOISY_SAMPLES)
    within = own * n / (2 * n - 2)        # pooled: (0 + n·own) over 2n − 2 repeats
    capped_var = within if pooled else 0.0
    return (CAP - kappa * np.sqrt(capped_var / n),
            np.mean(NOISY_SAMPLES) - kappa * np.sqrt(max(own, capped_var) / n))


@pytest.mark.parametrize("pooled", [True, False])
def test_the_noise_floor_lets_a_higher_noisy_setting_beat_an_exact_capped_one(pooled):
    g = guide(pooled)
    capped, noisy = bounds(g, pooled)
    # the case the switch is for: the noisy setting's mean is higher, yet without the
    # floor the capped one's bound (its mean) beats the noisy one's
    assert np.mean(NOISY_SAMPLES) > CAP
    best = tuple(int(i) for i in g.known.setting(0))
    if pooled:
        assert noisy > capped and best == NOISY
    else:
        assert capped > noisy and best == CAPPED


def test_the_floor_is_the_variance_pooled_within_settings():
    g = guide(True)
    n = len(NOISY_SAMPLES)
    assert g.pooled_variance() == pytest.approx(np.var(NOISY_SAMPLES) * n / (2 * n - 2))
    empty = Guide(GAME_GRID, DQNConfig(guided=True, lcb_pooled_noise=True),
                  np.random.default_rng(0))
    assert empty.pooled_variance() == 0.0      # no repeats yet: no floor
