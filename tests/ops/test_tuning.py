"""Tests of ``adaptiveload.ops._tuning``: the private override of the kernels' choices (values checked,
state restored on exit and on exceptions, what reaches the kernel module), the warning for the removed
environment variables, and a CUDA path that reads no environment and passes the kernels the op's own
arguments only. On a GPU: the override reaches the compiled kernels, also from a compiled graph."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections.abc import MutableMapping
from pathlib import Path

import pytest
import torch

import adaptiveload  # noqa: F401  (registers torch.ops.adaptiveload.*)
from adaptiveload.ops import _tuning, extension
from adaptiveload.ops.adaln_modulate import op as adaln_op
from adaptiveload.ops.rms_norm_modulate import op as rms_op
from adaptiveload.ops.testing import TOL, assert_rel

EPS = 1e-6
AUTO_NATIVE = (0, -1, -1, -1, -1, 8, False)  # set_tuning's arguments for the kernels' own choices


class RecordingKernels:
    """Stands in for the kernel module: records ``set_tuning`` calls, and each entry point's arguments
    (returning a marker instead of computing)."""

    def __init__(self):
        self.tuning, self.calls = [], []

    def set_tuning(self, *args):
        self.tuning.append(args)

    def __getattr__(self, name):  # forward, backward, rms_forward, rms_backward
        def entry(*args):
            self.calls.append((name, args))
            return ("kernel", name)
        return entry


@pytest.fixture
def recorder(monkeypatch):
    """The override pushes to a recording module, as it would to the built kernels on a GPU."""
    module = RecordingKernels()
    monkeypatch.setattr(_tuning, "_kernels", lambda: module)
    return module


def test_override_sets_nests_and_restores(recorder):
    """Each block forces what it names on top of what is in force, reaches the kernel module, and
    gives back exactly what it found: after a nested block, after the outer one, and after a raise."""
    assert _tuning.current() == _tuning.AUTO
    with _tuning.override(fwd_stages=0, max_threads=512) as outer:
        assert outer == _tuning.current() == _tuning.AUTO._replace(fwd_stages=0, max_threads=512)
        with _tuning.override(tail=(10, 4), store="bulk", two_kernel=True) as inner:
            assert inner.fwd_stages == 0 and inner.max_threads == 512 and inner.tail == (10, 4)
        assert _tuning.current() == outer
        with _tuning.override(fwd_stages="auto", tail=20, bwd_stages=3):
            assert _tuning.current() == _tuning.AUTO._replace(max_threads=512, tail=(20, 8), bwd_stages=3)
        with pytest.raises(KeyError):
            with _tuning.override(store="threads"):
                raise KeyError("inside")
        assert _tuning.current() == outer
    assert _tuning.current() == _tuning.AUTO
    assert recorder.tuning == [
        (512, 0, -1, -1, -1, 8, False),  # outer
        (512, 0, -1, 1, 10, 4, True),  # nested
        (512, 0, -1, -1, -1, 8, False),  # back to outer
        (512, -1, 3, -1, 20, 8, False),  # "auto" gives fwd_stages back to the kernels
        (512, 0, -1, -1, -1, 8, False),
        (512, 0, -1, 0, -1, 8, False),  # the block that raised
        (512, 0, -1, -1, -1, 8, False),  # ... restored
        AUTO_NATIVE,  # outer exit
    ]


def test_override_restores_when_the_kernels_refuse(monkeypatch):
    """A push that fails (kernels required but unbuildable) leaves the choices as they were."""
    def refuse():
        raise RuntimeError("adaptiveload: CUDA kernels required")

    monkeypatch.setattr(_tuning, "_kernels", refuse)
    with pytest.raises(RuntimeError, match="kernels required"):
        with _tuning.override(fwd_stages=2):
            pass
    assert _tuning.current() == _tuning.AUTO


@pytest.mark.parametrize("name, bad, expected", [
    ("max_threads", 31, "'auto' or an integer 32..512"), ("max_threads", 513, "32..512"),
    ("max_threads", "512", "32..512"), ("max_threads", True, "32..512"), ("max_threads", 256.0, "32..512"),
    ("fwd_stages", 1, "'auto', 0 or an integer 2..8"), ("fwd_stages", 9, "2..8"), ("bwd_stages", -1, "2..8"),
    ("bwd_stages", "3", "2..8"), ("fwd_stages", "AUTO", "2..8"),
    ("store", "tma", "'auto', 'threads' or 'bulk'"), ("store", 1, "'threads' or 'bulk'"),
    ("tail", 51, "a percent P (0..50)"), ("tail", -1, "0..50"), ("tail", (10, 0), "1..65536"),
    ("tail", (10, 65537), "1..65536"), ("tail", (10,), "0..50"), ("tail", (10, 8, 1), "0..50"), ("tail", "10/8", "0..50"),
    ("two_kernel", 1, "True or False"), ("two_kernel", "two_kernel", "True or False"),
])
def test_override_rejects_bad_values_naming_the_setting(recorder, name, bad, expected):
    with pytest.raises(ValueError, match=re.escape(f"override: {name}={bad!r}: expected")) as info:
        with _tuning.override(**{name: bad}):
            pytest.fail("entered with a bad value")
    assert expected in str(info.value)
    assert _tuning.current() == _tuning.AUTO and recorder.tuning == []  # nothing changed


def test_override_takes_the_documented_values(recorder):
    for kwargs, native in [
        (dict(max_threads=32), (32, -1, -1, -1, -1, 8, False)), (dict(max_threads=512), (512, -1, -1, -1, -1, 8, False)),
        (dict(fwd_stages=8, bwd_stages=2), (0, 8, 2, -1, -1, 8, False)), (dict(store="threads"), (0, -1, -1, 0, -1, 8, False)),
        (dict(tail=0), (0, -1, -1, -1, 0, 8, False)), (dict(tail=(50, 65536)), (0, -1, -1, -1, 50, 65536, False)),
        (dict(tail=(5, 1)), (0, -1, -1, -1, 5, 1, False)), (dict(two_kernel=False), AUTO_NATIVE),
        (dict(max_threads="auto", store="auto", tail="auto"), AUTO_NATIVE),
    ]:
        recorder.tuning.clear()
        with _tuning.override(**kwargs):
            pass
        assert recorder.tuning == [native, AUTO_NATIVE], kwargs


def test_override_rejects_unknown_settings():
    with pytest.raises(TypeError, match="row_order"):
        with _tuning.override(row_order="tile"):
            pass


def test_removed_variables_warn_once_naming_each(monkeypatch):
    for name in _tuning.REMOVED_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ADAPTIVELOAD_BWD", "two_kernel")
    monkeypatch.setenv("ADAPTIVELOAD_FWD_STAGES", "0")
    monkeypatch.setenv("ADAPTIVELOAD_CACHE", "/tmp/cache")  # still a setting: not named
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = _tuning.warn_removed_variables()
    assert found == ["ADAPTIVELOAD_FWD_STAGES", "ADAPTIVELOAD_BWD"]
    assert len(caught) == 1 and caught[0].category is UserWarning
    message = str(caught[0].message)
    assert "ADAPTIVELOAD_FWD_STAGES, ADAPTIVELOAD_BWD are set but ignored" in message
    assert "choose" in message and "ADAPTIVELOAD_CACHE" not in message


def test_no_warning_without_removed_variables(monkeypatch):
    for name in _tuning.REMOVED_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ADAPTIVELOAD_MAX_THREADS_X", "1")  # a longer name is not one of them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _tuning.warn_removed_variables() == []
    assert caught == []


def test_import_warns_once_about_a_removed_variable():
    """At import, in a fresh process: one warning, naming the variable set."""
    env = {k: v for k, v in os.environ.items() if k not in _tuning.REMOVED_VARIABLES}
    env.update(ADAPTIVELOAD_FWD_TAIL="10/8", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", "import adaptiveload, adaptiveload.ops"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("is set but ignored") == 1, out.stderr
    assert "ADAPTIVELOAD_FWD_TAIL is set but ignored" in out.stderr


class CountingEnviron(MutableMapping):
    """os.environ's stand-in that counts every read."""

    def __init__(self, data):
        self.data, self.reads = dict(data), 0

    def __getitem__(self, key):
        self.reads += 1
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value

    def __delitem__(self, key):
        del self.data[key]

    def __iter__(self):
        self.reads += 1
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_cuda_path_reads_no_environment_and_passes_only_the_op_arguments(monkeypatch):
    """The four CUDA implementations, kernel path (a recording module in place of the built one):
    no environment read on any call, first or repeated, and each entry point gets the op's own
    arguments, nothing else."""
    kernels = RecordingKernels()
    monkeypatch.setattr(extension, "kernels", lambda: kernels)
    x, w, scale, shift = torch.randn(2, 5, 8), torch.randn(8), torch.randn(2, 1, 8), torch.randn(2, 5, 8)
    mean, rstd, dy, addend = torch.randn(2, 5), torch.rand(2, 5) + 1, torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    calls = [
        ("forward", adaln_op._adaln_modulate_cuda, (x, w, None, scale, shift, EPS, torch.bfloat16)),
        ("backward", adaln_op._adaln_modulate_backward_cuda, (dy, x, w, None, scale, shift, mean, rstd, addend)),
        ("rms_forward", rms_op._rms_norm_modulate_cuda, (x, w, scale, None, EPS, torch.float32)),
        ("rms_backward", rms_op._rms_norm_modulate_backward_cuda, (dy, x, None, scale, shift, rstd, None)),
    ]
    environ = CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    for _ in range(3):
        for name, impl, args in calls:
            assert impl(*args) == ("kernel", name)
    assert environ.reads == 0
    assert [name for name, _ in kernels.calls] == [name for name, _, _ in calls] * 3
    for (name, got), (_, _, args) in zip(kernels.calls, calls * 3):
        assert len(got) == len(args) and all(g is a for g, a in zip(got, args)), name


def test_cuda_path_takes_the_reference_where_the_kernels_do_not_apply(monkeypatch):
    """float64 and bf16 modulation of float32 x run the reference, never the kernel module."""
    kernels = RecordingKernels()
    monkeypatch.setattr(extension, "kernels", lambda: kernels)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    scale = torch.randn(2, 1, 8, dtype=torch.float64)
    y, mean, rstd = adaln_op._adaln_modulate_cuda(x, None, None, scale, None, EPS, torch.float64)
    ref = torch.nn.functional.layer_norm(x, (8,), eps=EPS) * (1 + scale)
    torch.testing.assert_close(y, ref)
    y, rstd = rms_op._rms_norm_modulate_cuda(x.float(), None, scale.bfloat16(), None, EPS, torch.float32)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x.float(), (8,), eps=EPS) * (1 + scale.bfloat16().float()))
    assert kernels.calls == []


# ---------------------------------------------------------------------------------------------
# GPU: the override reaches the compiled kernels


@pytest.fixture(scope="module")
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ADAPTIVELOAD_REQUIRE_KERNEL", "1")
        yield extension.kernels()


@pytest.mark.cuda
def test_override_reaches_the_kernel_module(kernels):
    assert kernels.tuning() == AUTO_NATIVE
    with _tuning.override(max_threads=256, fwd_stages=3, bwd_stages=0, store="threads", tail=(5, 16), two_kernel=True):
        assert kernels.tuning() == (256, 3, 0, 0, 5, 16, True)
        with pytest.raises(ValueError):
            with _tuning.override(fwd_stages=2):
                assert kernels.tuning()[1] == 2
                raise ValueError("inside")
        assert kernels.tuning() == (256, 3, 0, 0, 5, 16, True)
    assert kernels.tuning() == AUTO_NATIVE
    assert "max_threads" in kernels.set_tuning(31, -1, -1, -1, -1, 8, False)  # the module checks too
    assert kernels.tuning() == AUTO_NATIVE


def _launched(fn) -> set:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "adaln" in e.name}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the shared-memory ring needs sm_90 bulk copies")
def test_override_holds_inside_a_compiled_graph(kernels):
    """A graph compiled once calls the op, whose kernels read the override at launch: the register
    forward (fwd_stages=0) and the two-kernel backward inside the block, the ring and one pass outside,
    both with gradients as close to float64 as bf16 allows."""
    x = torch.randn(2, 256, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    s, h = (0.1 * torch.randn(2, 2, 1, 1536, device="cuda")).unbind(0)

    @torch.compile(backend="inductor", fullgraph=True)
    def step(x):
        return torch.ops.adaptiveload.adaln_modulate(x, None, None, s, h, EPS, torch.bfloat16)[0]

    def run():
        x.grad = None
        y = step(x)
        y.float().square().sum().backward()
        return y.detach(), x.grad.clone()

    run()  # compiles
    default_kernels, default_run = _launched(run), run()
    with _tuning.override(fwd_stages=0, two_kernel=True):
        forced_kernels, forced_run = _launched(run), run()
    assert _launched(run) == default_kernels
    assert default_kernels != forced_kernels
    assert any("bwd_col_kernel" in k for k in forced_kernels) and not any("bwd_col_kernel" in k for k in default_kernels)
    x64 = x.detach().double().requires_grad_()
    y64 = torch.nn.functional.layer_norm(x64, (1536,), eps=EPS) * (1 + s.double()) + h.double()
    for name, (y, grad) in (("default", default_run), ("forced", forced_run)):
        # what reached the op's backward: 2 y of that run's own bf16 y (the register and ring forwards
        # may round an element differently), exact in bf16
        (ref,) = torch.autograd.grad(y64, x64, 2 * y.double(), retain_graph=True)
        # element by element too: dx is rounded once from float32 (half a bf16 ulp, 2**-9 relative), and
        # float32 errors of the row sums stay far below 1e-3 of the row's largest gradient
        bound = 2.0 ** -8 * ref.abs() + 1e-3 * ref.abs().amax(-1, keepdim=True)
        assert_rel(grad, ref, TOL[torch.bfloat16], f"dx ({name} kernels)")
        excess = (grad.double() - ref).abs() - bound
        worst = divmod(int(excess.argmax()), 1536)
        assert (excess <= 0).all(), (f"dx ({name} kernels): {int((excess > 0).sum())} elements beyond the bound; "
                                     f"worst at row {worst[0]}, column {worst[1]}: {excess.max().item():.3g} over")
