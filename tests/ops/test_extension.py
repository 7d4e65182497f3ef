"""Tests of the kernels' JIT build plumbing: source discovery (subfolders included), cache keys, the
file lock, the one-time fallback warning, ADAPTIVELOAD_REQUIRE_KERNEL, and two rules for csrc/: no atomics,
and TORCH_CHECK messages of text only (numbers and shapes through num() / dims())."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adaptiveload.ops import extension


@pytest.fixture
def fresh(monkeypatch):
    """The extension module with no build attempted yet (restored afterwards)."""
    monkeypatch.setattr(extension, "_module", None)
    monkeypatch.setattr(extension, "_failure", None)
    return extension


def test_no_atomics_in_csrc():
    """Gradients must be bit-reproducible: no atomicAdd (or any atomic) anywhere in the kernels."""
    src = extension.source_dir()
    files = extension.source_files(src)
    assert any(f.suffix == ".cu" for f in files)
    offenders = [str(f.relative_to(src)) for f in files if re.search(r"\batomic\w*\s*\(", f.read_text())]
    assert offenders == []


def _without_comments(text: str) -> str:
    """C++ source with its // and /* */ comments blanked (newlines kept), string and char literals intact."""
    out, i, quote = [], 0, None
    while i < len(text):
        c, two = text[i], text[i:i + 2]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            out.append(c)
        elif two in ("//", "/*"):
            stop = text.find("\n" if two == "//" else "*/", i + 2)
            stop = len(text) if stop < 0 else stop + (0 if two == "//" else 2)
            out.append(re.sub(r"[^\n]", " ", text[i:stop]))
            i = stop
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _walk(text: str, start: int):
    """(index, bracket depth before it) of each character from text[start] on; depth None inside a string
    or char literal (escapes included)."""
    depth, quote, i = 0, None, start
    while i < len(text):
        c = text[i]
        if quote:
            yield i, None
            if c == "\\" and i + 1 < len(text):
                i += 1
                yield i, None
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            yield i, None
        else:
            yield i, depth
            depth += (c in "([{") - (c in ")]}")
        i += 1


def _closing(text: str, start: int) -> int:
    """The index of the bracket that closes the one at text[start]."""
    for i, depth in _walk(text, start):
        if depth == 1 and text[i] in ")]}":
            return i
    raise AssertionError(f"unbalanced brackets from {text[start:start + 60]!r}")


def _macro_arguments(text: str, start: int) -> list[str]:
    """The top-level, comma-separated arguments of the macro call whose "(" is at text[start]."""
    end, cuts = _closing(text, start), [start]
    for i, depth in _walk(text, start):
        if i >= end:
            break
        if depth == 1 and text[i] == ",":
            cuts.append(i)
    cuts.append(end)
    return [text[a + 1:b].strip() for a, b in zip(cuts, cuts[1:])]


# What a check's message may hold: string literals, num(...) / dims(...) as a whole argument, a tensor's
# device or dtype (formatted by libc10 or as text), and these names, which are text (const char*) or a
# ScalarType (printed as its name).
_TEXT_PARTS = re.compile(r'(?:"(?:[^"\\]|\\.)*"\s*)+|\w+\.(?:device|scalar_type)\(\)|name|names\[i\]|dtype|ss\.dtype|'
                         r'[\w:]+ == [\w:]+ \? "[^"]*" : "[^"]*"')
_CHECKS = r"TORCH_CHECK|TORCH_CHECK_VALUE|TORCH_CHECK_INDEX|TORCH_CHECK_TYPE|TORCH_CHECK_NOT_IMPLEMENTED|TORCH_INTERNAL_ASSERT"


def _text_part(part: str) -> bool:
    m = re.match(r"(?:num|dims)\s*\(", part)
    if m:  # the whole argument one call: num(a) * b is not
        return _closing(part, m.end() - 1) == len(part) - 1
    return _TEXT_PARTS.fullmatch(part) is not None


def test_check_messages_in_csrc_hold_no_number_or_shape_but_through_num_or_dims():
    """TORCH_CHECK writes its message into a std::ostream; where the extension carries a static libstdc++
    a number written so is lost or ends the process (norm_modulate_ops.h), so numbers and shapes go
    through num() and dims(), which use std::to_string. Also refused: the comparison checks
    (TORCH_CHECK_EQ, ..., which print both numbers), and streams or c10::str anywhere in csrc/."""
    src = extension.source_dir()
    offenders, checks = [], 0
    for f in extension.source_files(src):
        text = _without_comments(f.read_text())
        where = lambda pos: f"{f.relative_to(src)}:{text.count(chr(10), 0, pos) + 1}"  # noqa: E731
        for m in re.finditer(r"\b(?:TORCH_CHECK_(?:EQ|NE|LT|LE|GT|GE)|TORCH_WARN\w*|c10::str|std::\w*stringstream|"
                             r"std::cout|std::cerr)\b", text):
            offenders.append(f"{where(m.start())}: {m.group()} (formats numbers through a stream)")
        for m in re.finditer(rf"\b(?:{_CHECKS})\s*\(", text):
            checks += 1
            for part in _macro_arguments(text, m.end() - 1)[1:]:
                if not _text_part(part):
                    offenders.append(f"{where(m.start())}: {' '.join(part.split())}")
    assert checks > 20
    assert offenders == [], "message parts that are not text (wrap numbers in num(), shapes in dims()):\n" + \
        "\n".join(offenders)


def test_source_dir_is_the_checkout_csrc():
    assert extension.source_dir() == Path(__file__).resolve().parents[2] / "csrc"


def _write(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_sources_are_found_in_subfolders(tmp_path):
    """Every file at any depth is a source file (hidden ones aside); every .cu at any depth is compiled."""
    src = _write(tmp_path, {"top.cu": "", "common.cuh": "", "norm/rms.cu": "", "norm/deep/rows.cuh": "",
                            "norm/NOTES.md": "", ".cache/stale.cu": "", "norm/.rms.cu.swp": ""})
    names = [p.relative_to(src).as_posix() for p in extension.source_files(src)]
    assert names == ["common.cuh", "norm/NOTES.md", "norm/deep/rows.cuh", "norm/rms.cu", "top.cu"]
    assert [p.relative_to(src).as_posix() for p in extension.cuda_sources(src)] == ["norm/rms.cu", "top.cu"]


def test_two_kernel_sources_of_one_name_raise_naming_both(tmp_path):
    """torch names an object after its source's file name: two rows.cu in two subfolders would collide."""
    src = _write(tmp_path, {"norm/rows.cu": "", "modulate/rows.cu": ""})
    with pytest.raises(RuntimeError, match=r"modulate/rows.cu and norm/rows.cu share the file name 'rows.cu'"):
        extension.cuda_sources(src)


def test_cache_key_changes_with_any_source_file_at_any_depth(monkeypatch, tmp_path):
    src = _write(tmp_path / "src", {"top.cu": "a", "norm/deep/rows.cuh": "b"})
    monkeypatch.setattr(extension, "source_dir", lambda: src)
    monkeypatch.setenv("ADAPTIVELOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    keys = {extension.cache_dir()}
    _write(src, {"norm/deep/rows.cuh": "c"})  # a header's contents
    keys.add(extension.cache_dir())
    (src / "norm" / "deep" / "rows.cuh").rename(src / "norm" / "rows.cuh")  # the same file, moved
    keys.add(extension.cache_dir())
    _write(src, {"norm/new.cuh": ""})  # a new file
    keys.add(extension.cache_dir())
    assert len(keys) == 4
    (src / "norm" / "new.cuh").unlink()
    assert extension.cache_dir() in keys  # the same tree, the same key


def test_cache_dir_is_keyed_by_torch_cuda_arch_and_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTIVELOAD_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    path = extension.cache_dir()
    assert path.parent == tmp_path
    assert "sm90" in path.name and f"cu{torch.version.cuda}" in path.name
    assert torch.__version__.replace("+", "_") in path.name
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert extension.cache_dir() != path


def test_cache_key_changes_with_the_compiler_flags_and_leaves_the_standard_to_torch(monkeypatch, tmp_path):
    """The kernels are built in the C++ standard torch's cpp_extension picks (torch 2.14's headers reject
    C++17), and a change of flags is a new cache folder."""
    assert not any(flag.startswith("-std") for flag in extension._NVCC_FLAGS)
    monkeypatch.setenv("ADAPTIVELOAD_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    path = extension.cache_dir()
    monkeypatch.setattr(extension, "_NVCC_FLAGS", [*extension._NVCC_FLAGS, "-DEXTRA"])
    assert extension.cache_dir() != path


def test_arch_list_needs_a_device_or_the_env(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="TORCH_CUDA_ARCH_LIST"):
        extension.arch_list()


def test_unavailable_kernels_warn_once_and_return_none(fresh, monkeypatch):
    monkeypatch.delenv("ADAPTIVELOAD_REQUIRE_KERNEL", raising=False)

    def broken(verbose=False):
        raise RuntimeError("nvcc not found (test)")

    monkeypatch.setattr(extension, "_build", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert extension.kernels() is None
        assert extension.kernels() is None
    messages = [str(w.message) for w in caught if "adaptiveload" in str(w.message)]
    assert len(messages) == 1 and "nvcc not found (test)" in messages[0]


def test_require_kernel_turns_the_fallback_into_an_error(fresh, monkeypatch):
    monkeypatch.setenv("ADAPTIVELOAD_REQUIRE_KERNEL", "1")
    monkeypatch.setattr(extension, "_build", lambda verbose=False: (_ for _ in ()).throw(RuntimeError("no nvcc")))
    with pytest.raises(RuntimeError, match="no nvcc"):
        extension.kernels()


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch message")
def test_build_without_cuda_torch_says_why(fresh, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    with pytest.raises(RuntimeError, match="without CUDA"):
        extension.build()


def test_build_removes_a_stale_baton_under_the_lock(fresh, monkeypatch, tmp_path):
    """torch's own baton file left by a killed builder would make cpp_extension.load wait forever."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("ADAPTIVELOAD_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    out = extension.cache_dir()
    out.mkdir(parents=True)
    (out / "lock").write_text("")
    calls = {}

    def fake_load(name, sources, build_directory, **kwargs):
        calls["baton_gone"] = not (Path(build_directory) / "lock").exists()
        calls["sources"] = sorted(Path(s).name for s in sources)
        calls["arch"] = os.environ["TORCH_CUDA_ARCH_LIST"]
        return SimpleNamespace(register_dispatch=lambda paths: calls.update(paths=sorted(paths)))

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert extension.build() == out
    assert calls["baton_gone"] and calls["arch"] == "9.0"
    assert calls["sources"] == sorted(p.name for p in extension.source_dir().rglob("*.cu"))
    # the loaded kernels get every op's Python CUDA path, for the calls they do not take
    assert calls["paths"] == ["adaln_modulate", "adaln_modulate_backward", "residual_adaln_modulate",
                              "residual_adaln_modulate_backward", "residual_rms_norm_modulate",
                              "residual_rms_norm_modulate_backward", "rms_norm_modulate",
                              "rms_norm_modulate_backward", "rms_norm_rope", "rms_norm_rope_backward"]


@pytest.mark.slow  # two Python subprocesses that import torch
def test_file_lock_is_released_when_its_holder_is_killed(tmp_path):
    lock = tmp_path / "adaptiveload.lock"
    hold = (
        "import time, pathlib; from adaptiveload.ops import extension; "
        f"held = extension._file_lock(pathlib.Path({str(lock)!r})); held.__enter__(); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        probe = [sys.executable, "-c",
                 f"import fcntl; f = open({str(lock)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)"]
        assert subprocess.run(probe, capture_output=True).returncode != 0  # held by the other process
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        with extension._file_lock(lock):  # would block forever if the lock outlived its holder
            pass
    finally:
        if holder.poll() is None:
            holder.kill()


@pytest.mark.cuda
def test_a_failing_check_inside_a_binding_raises_instead_of_ending_the_process():
    """The bindings' TORCH_CHECK messages carry shapes and integers: formatted through a std::ostream they
    ended the process on a host whose g++ links libstdc++ statically (num / dims in norm_modulate_ops.h)."""
    if extension.kernels() is None:  # (built here, so the child process loads them from the cache)
        pytest.skip("the CUDA kernels could not be built")
    code = ("import torch\nfrom adaptiveload.ops import extension\nk = extension.kernels()\nassert k is not None\n"
            "x = torch.randn(2, 5, 8, device='cuda')\n"
            "calls = [lambda: k.modulation_view(torch.randn(3, 1, 8, device='cuda'), x),\n"
            "         lambda: k.rms_backward(torch.randn(2, 4, 8, device='cuda'), x, None, torch.randn(2, 1, 8, "
            "device='cuda'), None, torch.ones(2, 5, device='cuda'), None)]\n"
            "for call in calls:\n    try:\n        call()\n        print('no error')\n"
            "    except RuntimeError as e:\n        print('raised:', str(e).splitlines()[0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    report = f"exit {done.returncode}; stdout {done.stdout[-500:]!r}; stderr {done.stderr[-2000:]!r}"
    assert done.returncode == 0, report
    lines = done.stdout.splitlines()
    assert len(lines) == 2, report
    assert lines[0].startswith("raised: norm_modulate kernels: t of shape [3, 1, 8] is not a modulation"), report
    assert lines[0].endswith("of x of shape [2, 5, 8]"), report
    expected = "raised: norm_modulate kernels (backward): dy shape [2, 4, 8] must equal x shape [2, 5, 8]"
    assert lines[1] == expected, report
