"""Step composition and the noise floor (adaptiveload/sched/metrics.py) against independent references:
scipy's two-sample KS statistic, numpy's correlation, hand-built step sequences, the normal distribution."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import ks_2samp

from adaptiveload.sched.metrics import composition, noise_floor


@given(st.lists(st.integers(1, 12), min_size=2, max_size=80), st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_composition_matches_scipy_and_numpy(corpus, num_steps, seed):
    """Random steps (each a random subset with repeats) of a corpus with ties: the mean KS statistic is
    scipy's ks_2samp per step, the lag-1 correlation numpy's of the steps' mean lengths."""
    rng = np.random.default_rng(seed)
    seq = np.array(corpus)
    steps = [rng.choice(len(seq), size=rng.integers(1, 2 * len(seq))) for _ in range(num_steps)]
    step = np.concatenate([np.full(len(s), k) for k, s in enumerate(steps)])
    ks, lag1 = composition(step[::-1], np.concatenate(steps)[::-1], seq)  # any order of the samples
    assert ks == pytest.approx(np.mean([ks_2samp(seq[s], seq, method="asymp").statistic for s in steps]), abs=1e-12)
    means = np.array([seq[s].mean() for s in steps])
    if num_steps >= 3 and means[:-1].std() > 0 and means[1:].std() > 0:
        assert lag1 == pytest.approx(np.corrcoef(means[:-1], means[1:])[0, 1], abs=1e-12)
    else:
        assert math.isnan(lag1)


def test_composition_of_hand_built_steps():
    seq = np.array([1560] * 6 + [75600] * 2)  # a corpus of 6 images and 2 long clips
    # every step holds the corpus's mix: KS 0
    assert composition([0] * 8 + [1] * 8, list(range(8)) * 2, seq)[0] == 0.0
    # steps of only images (F = 1 at 1560, the corpus 0.75) and only clips (F = 0 at 1560): 0.25 and 0.75
    images, clips = list(range(6)), [6, 7]
    ks, lag1 = composition([0] * 6 + [1] * 2 + [2] * 6 + [3] * 2, images + clips + images + clips, seq)
    assert ks == pytest.approx((0.25 + 0.75 + 0.25 + 0.75) / 4)
    assert lag1 == pytest.approx(-1.0)  # long, short, long, short
    with pytest.raises(ValueError, match="every step from 0 to the last must hold at least one sample"):
        composition([0, 2], [0, 1], seq)
    with pytest.raises(ValueError, match="equal lengths, got 3 and 2"):
        composition([0, 0, 1], [0, 1], seq)


def test_noise_floor_of_five_percent_noise():
    """W = 2: CV = E|Z1 - Z2| sigma / 2 = sigma / sqrt(pi) (to first order in sigma); the values the
    simulator reports at W = 2 / 8 / 64 / 1024."""
    assert noise_floor(2, 0.05)[0] == pytest.approx(0.05 / math.sqrt(math.pi), abs=1e-3)
    expected = {2: (0.029, 0.028), 8: (0.045, 0.065), 64: (0.050, 0.105), 1024: (0.050, 0.139)}
    for world, (cv, idle) in expected.items():
        got = noise_floor(world, 0.05)
        assert got == pytest.approx((cv, idle), abs=0.003), world
    # idle of W exactly balanced ranks: 1 - 1 / E[max of W noise factors] to first order; grows with W
    idle = [noise_floor(w, 0.05)[1] for w in (2, 8, 64, 1024)]
    assert idle == sorted(idle)
    assert noise_floor(8, 0.0) == (0.0, 0.0)
    assert noise_floor(8, 0.1)[0] == pytest.approx(2 * noise_floor(8, 0.05)[0], rel=0.02)
