"""3D RoPE: tables against a float64 hand-computed rotation, and relative-position invariance."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from adaptiveload.models.rope import THETA, apply_rope, rope_axis_dims, rope_tables


def hand_rotation(vec, position, head_dim):
    """Rotate one [head_dim] float64 vector at grid ``position = (t, h, w)`` pair by pair, in Python."""
    t_dim, h_dim, w_dim = rope_axis_dims(head_dim)
    out = vec.clone()
    start = 0
    for pos, part in zip(position, (t_dim, h_dim, w_dim)):
        for i in range(part // 2):
            angle = pos * THETA ** (-2 * i / part)
            a, b = vec[start + 2 * i].item(), vec[start + 2 * i + 1].item()
            out[start + 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            out[start + 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
        start += part
    return out


def token_index(position, grid):
    t, h, w = position
    return (t * grid[1] + h) * grid[2] + w


@pytest.mark.parametrize("head_dim,expected", [(6, (2, 2, 2)), (16, (8, 4, 4)), (128, (44, 42, 42))])
def test_axis_split_is_wans(head_dim, expected):
    assert rope_axis_dims(head_dim) == expected


@pytest.mark.parametrize("head_dim", [5, 4, 0])
def test_axis_split_rejects_bad_head_dim(head_dim):
    with pytest.raises(ValueError, match=str(head_dim)):
        rope_axis_dims(head_dim)


@given(
    head_dim=st.sampled_from([6, 8, 16, 22, 64]),
    grid=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 5)),
    data=st.data(),
)
def test_tables_match_hand_rotation(head_dim, grid, data):
    position = tuple(data.draw(st.integers(0, n - 1)) for n in grid)
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(1, grid[0] * grid[1] * grid[2], 2, head_dim, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(grid, head_dim, dtype=torch.float64)
    assert cos.shape == sin.shape == (x.shape[1], head_dim // 2)
    out = apply_rope(x, cos, sin)
    s = token_index(position, grid)
    for head in range(2):
        expected = hand_rotation(x[0, s, head], position, head_dim)
        torch.testing.assert_close(out[0, s, head], expected, rtol=1e-12, atol=1e-12)


@given(
    head_dim=st.sampled_from([6, 16, 24, 40]),
    p=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),
    q=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),
    shift=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)),
)
def test_score_depends_only_on_position_difference(head_dim, p, q, shift):
    """<R(p) a, R(q) b> == <R(p + d) a, R(q + d) b> for any shift d of both positions."""
    grid = (7, 7, 7)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(head_dim, generator=gen, dtype=torch.float64)
    b = torch.randn(head_dim, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(grid, head_dim, dtype=torch.float64)
    n = grid[0] * grid[1] * grid[2]
    x = torch.zeros(1, n, 2, head_dim, dtype=torch.float64)
    x[:, :, 0], x[:, :, 1] = a, b  # every token carries the same query a and key b
    rotated = apply_rope(x, cos, sin)

    def score(pa, pb):
        return torch.dot(rotated[0, token_index(pa, grid), 0], rotated[0, token_index(pb, grid), 1]).item()

    p2 = tuple(i + d for i, d in zip(p, shift))
    q2 = tuple(i + d for i, d in zip(q, shift))
    assert score(p2, q2) == pytest.approx(score(p, q), rel=1e-10, abs=1e-10)
    # and the rotation matters: the score at p == q (difference 0) is the plain dot product
    assert score(p, p) == pytest.approx(torch.dot(a, b).item(), rel=1e-10, abs=1e-10)


def test_bf16_input_keeps_dtype_and_rotates_in_float32():
    cos, sin = rope_tables((2, 3, 4), 16)
    x = torch.randn(2, 24, 4, 16)
    out = apply_rope(x.bfloat16(), cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), apply_rope(x.bfloat16().float(), cos, sin), rtol=1e-2, atol=1e-2)
