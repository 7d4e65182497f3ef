"""Pixel -> latent -> token conversion (adaptiveload/sched/shapes.py)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptiveload.sched import latent_shape, sequence_length, tokens_from_latent


def test_wan_anchor_values():
    # Wan 2.1 VAE (4x8x8) and 1x2x2 patches: 81x480x832 -> 32,760; 81x720x1280 -> 75,600; one 480x832 image -> 1,560
    assert sequence_length(81, 480, 832) == 32760
    assert sequence_length(81, 720, 1280) == 75600
    assert sequence_length(1, 480, 832) == 1560
    assert latent_shape(81, 480, 832).tolist() == [21, 60, 104]
    assert latent_shape(1, 720, 1280).tolist() == [1, 90, 160]


def test_vectorised_and_floored():
    s = sequence_length([1, 17, 81], [480, 486, 720], [832, 838, 1280])
    assert s.dtype == np.int64 and s.tolist() == [1560, 5 * 30 * 52, 75600]  # 486x838 floors to 480x832


@given(st.integers(1, 200), st.integers(16, 2000), st.integers(16, 2000))
def test_matches_hand_formula(frames, h, w):
    expected = ((frames - 1) // 4 + 1) * (h // 16) * (w // 16)
    assert sequence_length(frames, h, w) == expected
    assert int(tokens_from_latent(latent_shape(frames, h, w))) == expected


def test_configurable_strides_and_patch():
    # VAE stride 8x16x16 with patch 2x1x1: T = (33-1)//8+1 = 5 -> floored to 4 (multiple of pt=2)
    shape = latent_shape(33, 64, 48, vae_stride=(8, 16, 16), patch_size=(2, 1, 1))
    assert shape.tolist() == [4, 4, 3]
    assert sequence_length(33, 64, 48, vae_stride=(8, 16, 16), patch_size=(2, 1, 1)) == 2 * 4 * 3


@pytest.mark.parametrize("args, match", [((0, 480, 832), "num_frames 0"), ((1, 8, 832), "height 8"),
                                         ((1, 480, 15), "width 15")])
def test_too_small_raises(args, match):
    with pytest.raises(ValueError, match=match):
        sequence_length(*args)


def test_bad_patch_and_latent():
    with pytest.raises(ValueError, match="patch_size"):
        sequence_length(1, 480, 832, patch_size=(1, 0, 2))
    with pytest.raises(ValueError, match="not a positive multiple"):
        tokens_from_latent([[1, 61, 104]])
