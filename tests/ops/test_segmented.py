"""Tests of the segmented ops ``adaln_modulate_segmented`` and ``rms_norm_modulate_segmented`` (and
their backward ops): modulation [n, D] with one row per segment and ``segment_ids`` [T]. Values and
every gradient against float64 math written here (the modulation gathered to the tokens, then
LayerNorm / RMSNorm) over dtypes, optional inputs, id dtypes, unsorted ids, segments without rows,
strided modulation views and x of 2 or 3 dims; a hypothesis property; gradcheck; opcheck; determinism
of the segment sum; bad inputs (eager and fake); what autograd saves (no per-token tensor but x);
torch.compile with a dynamic number of rows (and an unbacked number of segments); the functional
API's ``segment_ids`` path against its per-token call."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import adaptiveload  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload import functional
from adaptiveload.ops import segmented
from adaptiveload.ops.testing import (GRAD_LAYOUTS, OPCHECK_UTILS, TOL, assert_rel, check_backward_strides,
                                       check_op_against_float64, lay_out_grad)

EPS = 1e-6
KINDS = ("adaln", "rms")
OPS = {"adaln": torch.ops.adaptiveload.adaln_modulate_segmented,
       "rms": torch.ops.adaptiveload.rms_norm_modulate_segmented}
BACKWARDS = {"adaln": torch.ops.adaptiveload.adaln_modulate_segmented_backward,
             "rms": torch.ops.adaptiveload.rms_norm_modulate_segmented_backward}
PARAMS = {"adaln": ("weight", "bias"), "rms": ("weight",)}


def call(kind, v, segment_ids, out_dtype):
    """The segmented op of ``kind`` on the inputs by name (``v``; absent ones None or missing)."""
    params = [v.get(name) for name in PARAMS[kind]]
    return OPS[kind](v["x"], *params, v["scale"], v.get("shift"), segment_ids, EPS, out_dtype)


def call_backward(kind, dy, v, segment_ids, stats):
    params = [v.get(name) for name in PARAMS[kind]]
    return BACKWARDS[kind](dy, v["x"], *params, v["scale"], v.get("shift"), segment_ids, *stats)


def reference(kind, v, segment_ids):
    """y in the inputs' dtype (float64 in the tests), written out: each row's modulation gathered from
    its segment's, then ``norm(x) [* weight] [+ bias]``, ``* (1 + scale) [+ shift]``."""
    x, ids = v["x"], segment_ids.long()
    if kind == "adaln":
        centred = x - x.mean(-1, keepdim=True)
        n = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + EPS)
    else:
        n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    if v.get("weight") is not None:
        n = n * v["weight"]
    if v.get("bias") is not None:
        n = n + v["bias"]
    y = n * (1 + v["scale"][ids].view(x.shape))
    return y if v.get("shift") is None else y + v["shift"][ids].view(x.shape)


def make_inputs(kind, x_shape, n, dtype, seed, *, shifted=True, affine=True, strided=True, mod_dtype=None,
                id_dtype=torch.int64, ids_below=None, device="cpu"):
    """Inputs by name, segment_ids and dy. x of mean 0.3 and std 2, modulation of std 0.5 in ``mod_dtype``
    (default x's); ``strided``: scale the middle third of a [n, 3D] leaf (a ``.chunk()``), shift row 1
    of a [n, 2, D] leaf (``m[:, 1]``). Ids uniform in [0, ids_below or n), unsorted (ids_below < n:
    the segments from ids_below on have no rows)."""
    gen = torch.Generator().manual_seed(seed)
    D, mod_dtype = x_shape[-1], mod_dtype or dtype
    T = torch.Size(x_shape[:-1]).numel()

    def randn(*shape, std=1.0, to=dtype):
        return (std * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(to).to(device)

    def mod(leaf_shape, view):  # strided: a view of a larger leaf
        return view(randn(*leaf_shape, std=0.5, to=mod_dtype)) if strided else randn(n, D, std=0.5, to=mod_dtype)

    scale = mod((n, 3 * D), lambda m: m.chunk(3, dim=-1)[1])
    shift = mod((n, 2, D), lambda m: m[:, 1]) if shifted else None
    named = {"x": (randn(*x_shape) * 2 + 0.3), "scale": scale, "shift": shift}
    if affine:
        named["weight"] = 1 + randn(D, std=0.3)
        if kind == "adaln":
            named["bias"] = randn(D, std=0.3)
    ids = torch.randint(0, ids_below or n, (T,), generator=gen).to(device, id_dtype)
    return named, ids, randn(*x_shape)


def check_against_float64(kind, named, ids, dy, tol):
    """The op forward and backward against float64 autograd of :func:`reference`: y, the statistics,
    the gradient of every input (of the leaf of a view); y in x's dtype."""
    dtype = named["x"].dtype
    outputs, ref = check_op_against_float64(named, lambda v: call(kind, v, ids, dtype),
                                            lambda v: reference(kind, v, ids), dy, tol)
    y, *stats = outputs
    xd = ref["x"]
    centred = xd - xd.mean(-1, keepdim=True) if kind == "adaln" else xd
    rstd_ref = centred.square().mean(-1).add(EPS).rsqrt()
    assert y.dtype == dtype
    assert_rel(stats[-1], rstd_ref, tol, "rstd")
    if kind == "adaln":
        assert_rel(stats[0], xd.mean(-1), tol, "mean")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, mod_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shifted, affine", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("x_shape, id_dtype", [((1, 37, 24), torch.int64), ((37, 24), torch.int32),
                                               ((1, 37, 24), torch.int32)])
@pytest.mark.parametrize("strided", [True, False])
def test_matches_float64(kind, dtype, mod_dtype, shifted, affine, x_shape, id_dtype, strided):
    """Unsorted ids with the last of 6 segments empty; strided or contiguous modulation."""
    named, ids, dy = make_inputs(kind, x_shape, 6, dtype, 1, shifted=shifted, affine=affine, strided=strided,
                                 mod_dtype=mod_dtype, id_dtype=id_dtype, ids_below=5)
    assert not torch.equal(ids.sort().values, ids)
    check_against_float64(kind, named, ids, dy, TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_segment_without_rows_gets_zero_gradient(kind):
    named, ids, dy = make_inputs(kind, (1, 20, 8), 4, torch.float32, 2, strided=False)
    ids[ids == 2] = 3  # segment 2 has no rows
    for t in named.values():
        t.requires_grad_(True)
    y = call(kind, named, ids, torch.float32)[0]
    dscale, dshift = torch.autograd.grad(y, (named["scale"], named["shift"]), dy)
    assert (dscale[2] == 0).all() and (dshift[2] == 0).all()
    assert (dscale[[0, 1, 3]] != 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_no_rows(kind):
    """T = 0: an empty y and statistics, zero modulation gradients of [n, D]."""
    named, ids, dy = make_inputs(kind, (1, 0, 8), 3, torch.float32, 3)
    check_against_float64(kind, named, ids, dy, TOL[torch.float32])


@given(kind=st.sampled_from(KINDS), x_shape=st.sampled_from([(1, 1), (1, 7), (1, 50), (13,), (2, 9)]),
       D=st.sampled_from([1, 3, 8, 40, 130]), n=st.integers(1, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), shifted=st.booleans(),
       affine=st.booleans(), strided=st.booleans(), id_dtype=st.sampled_from([torch.int32, torch.int64]),
       seed=st.integers(0, 2**16))
def test_property_matches_float64(kind, x_shape, D, n, dtype, shifted, affine, strided, id_dtype, seed):
    named, ids, dy = make_inputs(kind, (*x_shape, D), n, dtype, seed, shifted=shifted, affine=affine,
                                 strided=strided, id_dtype=id_dtype)
    check_against_float64(kind, named, ids, dy, TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Registration checks


def _leaves(named):
    """Every input's leaf (a view's base) marked to require grad."""
    for t in named.values():
        if t is not None:
            (t._base if t._base is not None else t).requires_grad_(True)
    return named


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shifted", [True, False])
def test_gradcheck_float64(kind, shifted):
    named, ids, _ = make_inputs(kind, (1, 9, 5), 4, torch.float64, 4, shifted=shifted, id_dtype=torch.int32,
                                ids_below=3)
    names = [name for name, t in named.items() if t is not None]
    mods = {name: named[name] for name in ("scale", "shift") if name in names}
    leaves = [(named[name]._base if named[name]._base is not None else named[name]).detach().requires_grad_(True)
              for name in names]

    def fn(*leaves):
        v = {name: leaf if name not in mods else leaf.as_strided(mods[name].shape, mods[name].stride(),
                                                                  mods[name].storage_offset())
             for name, leaf in zip(names, leaves)}
        return call(kind, v, ids, torch.float64)[0]

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shifted, affine, strided", [(True, True, True), (False, False, False), (True, False, True)])
@pytest.mark.parametrize("x_shape", [(1, 11, 8), (11, 8)])
def test_opcheck(kind, shifted, affine, strided, x_shape):
    named, ids, _ = make_inputs(kind, x_shape, 3, torch.float32, 5, shifted=shifted, affine=affine, strided=strided)
    v = _leaves(named)
    params = [v.get(name) for name in PARAMS[kind]]
    torch.library.opcheck(OPS[kind].default, (v["x"], *params, v["scale"], v.get("shift"), ids, EPS, torch.float32),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grad_layout", GRAD_LAYOUTS)
def test_opcheck_backward(kind, grad_layout):
    """The backward op's outputs are contiguous (as its fake kernel promises), whatever dy's layout;
    the modulation gradients [n, D] in the modulation's dtype, that of segment_ids empty."""
    named, ids, dy = make_inputs(kind, (1, 11, 8), 3, torch.float32, 6, mod_dtype=torch.float64)
    stats = call(kind, named, ids, torch.float32)[1:]
    dy = lay_out_grad(grad_layout, dy)
    params = [named.get(name) for name in PARAMS[kind]]
    args = (dy, named["x"], *params, named["scale"], named["shift"], ids, *stats)
    check_backward_strides(BACKWARDS[kind], args, ("dx", *(f"d{p}" for p in PARAMS[kind]), "dscale", "dshift", "dids"))
    *_, dscale, dshift, dids = BACKWARDS[kind](*args)
    assert dscale.shape == dshift.shape == (3, 8) and dscale.dtype == dshift.dtype == torch.float64
    assert dids.shape == (0,)


# ---------------------------------------------------------------------------------------------
# The segmented CUDA kernels (csrc/norm_modulate*: SEG), against float64


def _pack_ids(lengths, id_dtype, device):
    """The ids of a pack of segments of these lengths (0 for a segment without rows), in order."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device, id_dtype)


def _kernel_path(kind, named, ids):
    """The kernels' own forward and backward results (the bindings, no composite behind them): both
    non-empty, so the case under test runs the segmented kernels."""
    from adaptiveload.ops import extension
    ops = extension.kernels()
    v, rms = named, kind == "rms"
    weight, bias = v.get("weight"), v.get("bias")
    out = ops.segmented_forward(v["x"], weight, bias, v["scale"], v.get("shift"), ids, EPS, v["x"].dtype, rms)
    assert out, "the segmented forward kernel handed the call back"
    dy = torch.randn_like(v["x"])
    grads = ops.segmented_backward(dy, v["x"], weight, bias, v["scale"], v.get("shift"), ids, out[1], out[2])
    assert grads, "the segmented backward kernel handed the call back"
    return out, grads, dy


# lengths of a pack's segments: Wan-like clips and images, an empty segment, one-row segments
PACKS = {"clips": [1200, 0, 300, 300, 2000, 7], "images": [1] * 5 + [256] * 20 + [3], "one": [4099]}


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, mod_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                              (torch.float16, None), (torch.float32, None)])
@pytest.mark.parametrize("D", [64, 1536, 3072])
@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("order", ["pack", "shuffled"])
def test_cuda_kernels_match_float64(kind, dtype, mod_dtype, D, pack, order):
    """The segmented kernels take the call (both bindings return results) and match float64 in y, the
    statistics and every gradient: ids in pack order (the row tiles cut at segment changes) and the
    same ids shuffled (the on-device fallback: one column kernel sums each segment in row order)."""
    lengths = PACKS[pack]
    gen = torch.Generator().manual_seed(D + len(lengths))
    named, _, dy = make_inputs(kind, (1, sum(lengths), D), len(lengths), dtype, D, mod_dtype=mod_dtype,
                               device="cuda")
    ids = _pack_ids(lengths, torch.int32 if D == 1536 else torch.int64, "cuda")
    if order == "shuffled":
        ids = ids[torch.randperm(ids.numel(), generator=gen).cuda()]
    _kernel_path(kind, named, ids)
    check_against_float64(kind, named, ids, dy, TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("order", ["pack", "shuffled"])
def test_cuda_kernels_backward_bit_identical(kind, order):
    """Two backward runs of the segmented kernels give the same bits (no atomics), in pack order and
    shuffled, with more segments (200) than the fallback's shared memory holds in one pass (128)."""
    lengths = [37] * 100 + [0] + [401] * 99
    named, _, dy = make_inputs(kind, (1, sum(lengths), 1536), len(lengths), torch.bfloat16, 8, device="cuda")
    ids = _pack_ids(lengths, torch.int64, "cuda")
    if order == "shuffled":
        ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(8)).cuda()]
    stats = call(kind, named, ids, torch.bfloat16)[1:]
    first, second = (call_backward(kind, dy, named, ids, stats) for _ in range(2))
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)
    check_against_float64(kind, named, ids, dy, TOL[torch.bfloat16])


# ---------------------------------------------------------------------------------------------
# Determinism, memory, compile


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_backward_is_deterministic(kind, device):
    """Two backward runs bit-identical (on CPU with 1 and 4 threads too): the segment sum has no atomics."""
    named, ids, dy = make_inputs(kind, (1, 4096, 64), 7, torch.float32, 7, device=device)
    stats = call(kind, named, ids, torch.float32)[1:]
    first = call_backward(kind, dy, named, ids, stats)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 4)
        second = call_backward(kind, dy, named, ids, stats)
    finally:
        torch.set_num_threads(threads)
    for g1, g2 in zip(first, second):
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_one_hot_sum_is_each_segments_row_sum_at_full_precision(device):
    """The CUDA segment sum (segmented.one_hot_sum) against a float64 loop over segments, unsorted ids
    and an empty segment included; float32 within its rounding even with TF32 allowed by the user."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 6, (3000,), generator=gen)
    ids[ids == 4] = 5  # segment 4 has no rows
    grad = torch.randn(3000, 40, generator=gen, dtype=torch.float64)
    ref = torch.stack([grad[ids == k].sum(0) for k in range(6)])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        got = segmented.one_hot_sum(grad.float().to(device), ids.to(torch.int32).to(device), 6)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert torch.backends.cuda.matmul.allow_tf32 == tf32  # restored
    assert got.dtype == torch.float32 and not got[4].any()
    assert_rel(got.cpu(), ref, 1e-6, "one_hot_sum")
    assert_rel(segmented.one_hot_sum(grad.to(device), ids.to(device), 6).cpu(), ref, 1e-14, "one_hot_sum float64")


def _saved_shapes(fn):
    """``fn()`` with every tensor autograd saves recorded: the result and the saved tensors."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_saves_no_per_token_modulation(kind, dtype):
    """The segmented op saves x, the compact modulation, segment_ids and the statistics: no tensor of
    T * D elements but x itself. (The per-token call of the base op, for contrast, saves its gathered
    modulation.)"""
    T, D, n = 64, 16, 3
    named, ids, _ = make_inputs(kind, (1, T, D), n, dtype, 8)
    v = _leaves(named)
    x = v["x"]

    def big_but_x(saved):
        return [list(t.shape) for t in saved if t.numel() >= T * D and t.data_ptr() != x.data_ptr()]

    y, saved = _saved_shapes(lambda: call(kind, v, ids, dtype)[0])
    assert y.requires_grad and any(t.data_ptr() == x.data_ptr() for t in saved)
    assert big_but_x(saved) == []
    assert {tuple(t.shape) for t in saved} <= {(1, T, D), (D,), (n, D), (T,), (1, T)}
    per_token = {**v, "scale": v["scale"][ids][None], "shift": v["shift"][ids][None]}
    base = torch.ops.adaptiveload.adaln_modulate if kind == "adaln" else torch.ops.adaptiveload.rms_norm_modulate
    params = [per_token.get(name) for name in PARAMS[kind]]
    _, saved = _saved_shapes(lambda: base(x, *params, per_token["scale"], per_token["shift"], EPS, dtype)[0])
    assert [1, T, D] in big_but_x(saved)


def _compiled_function(kind):
    def f(x, emb, weight, segment_ids):
        scale, shift = emb.chunk(2, dim=-1)
        if kind == "adaln":
            y = functional.adaln_modulate(x, scale, shift, weight=weight, segment_ids=segment_ids)
        else:
            y = functional.rms_norm_modulate(x, scale, shift, weight=weight, segment_ids=segment_ids)
        return y.square().sum()

    return f


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("unbacked_n", [False, True])
def test_compile_with_dynamic_rows_matches_eager(kind, unbacked_n):
    """torch.compile(fullgraph, aot_eager) over packs of 23 and 41 rows: no recompile (T dynamic), the
    loss and every gradient equal to eager's; n (the segments) also unbacked, as the packed Wan
    model marks it."""
    f = _compiled_function(kind)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for T, seed in ((23, 9), (41, 10)):
                gen = torch.Generator().manual_seed(seed)
                x, emb, w = (torch.randn(*shape, generator=gen) for shape in ((1, T, 8), (3, 16), (8,)))
                ids = torch.randint(0, 3, (T,), generator=gen, dtype=torch.int32)
                results = []
                for fn in (f, compiled):
                    inputs = [t.clone().requires_grad_(True) for t in (x, emb, w)]
                    if fn is compiled and unbacked_n:
                        torch._dynamo.decorators.mark_unbacked(inputs[1], 0)
                    loss = fn(*inputs, ids)
                    results.append((loss, *torch.autograd.grad(loss, inputs)))
                for name, eager, got in zip(("loss", "dx", "demb", "dweight"), *results):
                    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5, msg=name)
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Bad inputs


def _bad_case(kind, **changes):
    """Good inputs (x [1, 5, 8], n = 3), with ``changes`` (by name) applied."""
    named, ids, _ = make_inputs(kind, (1, 5, 8), 3, torch.float32, 11, strided=False)
    return {**named, "segment_ids": ids, "eps": EPS, "out_dtype": torch.float32, **changes}


BAD = [
    (dict(segment_ids=torch.zeros(1, 5, dtype=torch.int64)), ["segment_ids", "[1, 5]", "1-D int32 or int64"]),
    (dict(segment_ids=torch.zeros(5)), ["segment_ids", "[5]", "torch.float32"]),
    (dict(segment_ids=torch.zeros(4, dtype=torch.int64)), ["segment_ids", "[4]", "one id per row of x", "5 rows"]),
    (dict(segment_ids=torch.zeros(5, dtype=torch.int64, device="meta")), ["segment_ids", "[5]", "is on meta"]),
    (dict(segment_ids=torch.tensor([0, 1, 2, 3, 0])), ["segment_ids", "[5]", "holds 3 at row 3", "[0, 3)"]),
    (dict(segment_ids=torch.tensor([0, 1, -1, 2, 9], dtype=torch.int32)), ["segment_ids", "holds -1 at row 2"]),
    (dict(scale=torch.zeros(3, 1, 8)), ["scale", "[3, 1, 8]", "[n, 8]"]),
    (dict(scale=torch.zeros(8)), ["scale", "[8]", "[n, 8]"]),
    (dict(scale=torch.zeros(3, 7)), ["scale", "[3, 7]"]),
    (dict(scale=torch.zeros(3, 8, dtype=torch.int64)), ["scale", "torch.int64"]),
    (dict(shift=torch.zeros(4, 8)), ["shift", "[4, 8]", "scale's 3 rows"]),
    (dict(shift=torch.zeros(1, 3, 8)), ["shift", "[1, 3, 8]"]),
    (dict(weight=torch.ones(9)), ["weight", "[9]"]),
    (dict(x=torch.zeros(8)), ["x", "[8]", "at least 2 dims"]),
    (dict(eps=-1.0), ["eps must be a non-negative number"]),
    (dict(out_dtype=torch.int32), ["out_dtype must be a floating dtype"]),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("changes, names", BAD)
def test_bad_inputs_raise_value_error_naming_the_tensor(kind, changes, names):
    a = _bad_case(kind, **changes)
    params = [a.get(name) for name in PARAMS[kind]]
    with pytest.raises(ValueError) as err:
        OPS[kind](a["x"], *params, a["scale"], a["shift"], a["segment_ids"], a["eps"], a["out_dtype"])
    for name in (f"{kind}_modulate_segmented" if kind == "adaln" else "rms_norm_modulate_segmented", *names):
        assert name in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("changes, names", [c for c in BAD if not any("holds" in name for name in c[1])][:6])
def test_fake_kernels_check_shapes(kind, changes, names):
    """The fake kernel raises the eager kernel's ValueError for shapes, dtypes and devices (never for
    id values, which it cannot read)."""
    a = _bad_case(kind, **changes)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for k, t in a.items()}
        params = [fake.get(name) for name in PARAMS[kind]]
        with pytest.raises(ValueError) as err:
            OPS[kind](fake["x"], *params, fake["scale"], fake["shift"], fake["segment_ids"], fake["eps"],
                      fake["out_dtype"])
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_backward_bad_inputs_raise(kind):
    """The backward op checks its inputs too (it is public): ids, dy, statistics."""
    named, ids, dy = make_inputs(kind, (1, 5, 8), 3, torch.float32, 12)
    stats = call(kind, named, ids, torch.float32)[1:]
    op = f"{'adaln_modulate' if kind == 'adaln' else 'rms_norm_modulate'}_segmented_backward"
    with pytest.raises(ValueError, match=rf"{op}: segment_ids \(shape \[4\]"):
        call_backward(kind, dy, named, ids[:4], stats)
    with pytest.raises(ValueError, match=rf"{op}: segment_ids \(shape \[5\].* holds 3 at row 0"):
        call_backward(kind, dy, named, torch.full((5,), 3), stats)
    with pytest.raises(ValueError, match=rf"{op}: dy \(shape \[1, 5, 7\]"):
        call_backward(kind, dy[..., :7], named, ids, stats)
    with pytest.raises(ValueError, match=rf"{op}: rstd \(shape \[1, 4\]"):
        call_backward(kind, dy, named, ids, (*stats[:-1], stats[-1][:, :4]))


# ---------------------------------------------------------------------------------------------
# Functional API


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("x_shape", [(1, 30, 16), (30, 16)])
def test_functional_segment_ids_matches_the_per_token_call(kind, x_shape):
    """y bit for bit (the same base op on the same per-token values), the gradients to float32
    rounding (the per-token call sums the modulation gradient through autograd's index backward)."""
    named, ids, dy = make_inputs(kind, x_shape, 4, torch.float32, 13)
    fn = functional.adaln_modulate if kind == "adaln" else functional.rms_norm_modulate
    results = []
    for segmented in (True, False):
        v = {name: t.detach().clone().requires_grad_(True) for name, t in named.items()}
        mods = ((v["scale"], v["shift"]) if segmented else
                (v["scale"][ids].view(x_shape), v["shift"][ids].view(x_shape)))
        kwargs = {name: v[name] for name in PARAMS[kind]}
        y = fn(v["x"], *mods, segment_ids=ids if segmented else None, **kwargs)
        results.append((y, *torch.autograd.grad(y, list(v.values()), dy)))
    (y, *grads), (y_ref, *ref_grads) = results
    assert torch.equal(y, y_ref)
    for name, g, r in zip(named, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_functional_segment_ids_bad_input():
    x, scale = torch.randn(1, 5, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"segment_ids \(shape \[4\]"):
        functional.adaln_modulate(x, scale, segment_ids=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"scale \(shape \[3, 1, 8\]"):
        functional.rms_norm_modulate(x, scale[:, None], segment_ids=torch.zeros(5, dtype=torch.int64))


@given(n=st.integers(1, 5), t=st.integers(0, 40), d=st.integers(1, 9), seed=st.integers(0, 2**16),
       id_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_gather_by_segment_forward_and_backward_against_float64(n, t, d, seed, id_dtype):
    """Forward: each token's row of ``rows`` (exactly). Backward: each segment's gradient rows summed,
    against a float64 loop over segments, for ids in any order and segments without tokens; a float32
    and a bfloat16 ``rows`` get their sum accumulated in float32 and rounded once."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, n, (t,), generator=gen).to(id_dtype)
    grad = torch.randn(t, d, generator=gen, dtype=torch.float64)
    ref = torch.stack([grad[ids.long() == k].sum(0) for k in range(n)])
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        rows = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        out = segmented.gather_by_segment(rows, ids)
        assert out.dtype == dtype and out.shape == (t, d)
        assert torch.equal(out, rows.detach()[ids.long()])
        out.backward(grad.to(dtype))
        expected = torch.stack([grad.to(dtype).double()[ids.long() == k].sum(0) for k in range(n)])
        assert rows.grad.dtype == dtype
        assert_rel(rows.grad.double(), expected, tol, f"gather_by_segment {dtype}")
        if dtype == torch.float64:
            assert_rel(rows.grad, ref, tol, "gather_by_segment float64 against the float64 loop")


def test_gather_by_segment_sums_a_long_segment_in_float32():
    """20,000 bf16 gradient rows into one segment: the float32 accumulation is within bf16's final
    rounding of the exact sum (a bf16 running sum would stall far from it)."""
    ids = torch.zeros(20_000, dtype=torch.int64)
    rows = torch.zeros(1, 4, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.full((20_000, 4), 0.01, dtype=torch.bfloat16)
    segmented.gather_by_segment(rows, ids).backward(grad)
    exact = 20_000 * grad[0, 0].double()
    assert abs(rows.grad[0, 0].double() - exact) <= 2 ** -8 * exact


def test_gather_by_segment_backward_is_deterministic():
    """The same gradient bits on every run (the segment sum has no atomics)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3, (5000,), generator=gen)
    grad = torch.randn(5000, 16, generator=gen)
    results = []
    for _ in range(3):
        rows = torch.zeros(3, 16, requires_grad=True)
        segmented.gather_by_segment(rows, ids).backward(grad)
        results.append(rows.grad)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("rows, ids, message", [
    (torch.zeros(3), torch.zeros(2, dtype=torch.int64), r"rows \(shape \[3\].*floating \[n, D\]"),
    (torch.zeros(3, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), r"rows \(shape \[3, 2\], dtype torch.int64"),
    (torch.zeros(3, 2), torch.zeros(2, 1, dtype=torch.int64), r"segment_ids \(shape \[2, 1\].*1-D int32 or int64"),
    (torch.zeros(3, 2), torch.zeros(2), r"segment_ids \(shape \[2\], dtype torch.float32"),
    (torch.zeros(3, 2), torch.tensor([0, 3]), r"segment_ids \(shape \[2\].*holds 3 at row 1, outside \[0, 3\)"),
])
def test_gather_by_segment_bad_input_names_the_tensor(rows, ids, message):
    with pytest.raises(ValueError, match=message):
        segmented.gather_by_segment(rows, ids)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_by_segment_cuda_matches_float64_and_repeats_its_bits(dtype):
    """On CUDA (the one-hot GEMM sum): a pack's sorted ids and shuffled ids, against float64; the same
    bits on a second run."""
    gen = torch.Generator().manual_seed(11)
    sorted_ids = torch.arange(4).repeat_interleave(torch.tensor([3000, 1, 0, 9000]))
    for ids in (sorted_ids, sorted_ids[torch.randperm(sorted_ids.numel(), generator=gen)]):
        grad = torch.randn(ids.numel(), 64, generator=gen).to(dtype)
        expected = torch.stack([grad.double()[ids == k].sum(0) for k in range(4)])
        grads = []
        for _ in range(2):
            rows = torch.zeros(4, 64, dtype=dtype, device="cuda", requires_grad=True)
            segmented.gather_by_segment(rows, ids.cuda()).backward(grad.cuda())
            grads.append(rows.grad)
        assert torch.equal(grads[0], grads[1])
        assert_rel(grads[0].double().cpu(), expected, 1e-6 if dtype == torch.float32 else 8e-3, f"cuda {dtype}")
