"""Packaging: a wheel built by pip ships every kernel source (csrc/, subfolders included) inside the
package, a non-editable install of it finds them there, and they compile where nvcc exists; the
package list in pyproject.toml names every package."""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from adaptiveload.ops import extension

ROOT = Path(__file__).resolve().parents[2]
# what a build of the checkout must not copy: version control, environments, build and run outputs
_NOT_COPIED = {".git", ".venv", "build", "dist", "runs", ".whl", "__pycache__", ".hypothesis", ".pytest_cache"}


def _relative(paths, base: Path) -> set[str]:
    return {p.relative_to(base).as_posix() for p in paths}


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured; fails the test with that output when it exits non-zero."""
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def _build_isolation() -> list[str]:
    """``--no-build-isolation`` where this environment's setuptools builds wheels itself (70.1+; no
    download), else nothing (pip then fetches setuptools into an isolated build environment)."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return []
    major_minor = tuple(int(p) if p.isdecimal() else 0 for p in version.split(".")[:2])
    return ["--no-build-isolation"] if major_minor >= (70, 1) else []


def test_pyproject_lists_every_package():
    """The packages are listed in pyproject.toml (adaptiveload._csrc has no folder of its own to be
    found), so a new subpackage missing from the list would be missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "adaptiveload").rglob("__init__.py")}
    assert sorted(config["packages"]) == sorted(found | {"adaptiveload._csrc"})
    assert config["package-dir"] == {"adaptiveload._csrc": "csrc"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the checkout, so that the build writes nothing into it (pip builds in the tree)."""
    dst = tmp_path_factory.mktemp("checkout") / "adaptiveload"
    shutil.copytree(ROOT, dst, ignore=lambda _, names: [n for n in names if n in _NOT_COPIED or n.endswith(".egg-info")])
    return dst


@pytest.fixture(scope="module")
def wheel(tree, tmp_path_factory) -> Path:
    """``pip wheel --no-deps`` of the copy: the wheel file."""
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *_build_isolation(), str(tree), "-w", str(out)])
    (built,) = out.glob("adaptiveload-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (no dependencies, not editable); torch
    and the other dependencies come from this environment's site-packages (a ``.pth`` file: a venv
    made from inside a venv sees the base interpreter's packages, not this venv's). Its python."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    here = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (purelib / "adaptiveload_test_deps.pth").write_text("".join(f"{p}\n" for p in here))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    return python


@pytest.mark.slow
def test_wheel_ships_every_kernel_source(wheel, tree):
    """Every file under csrc/ (subfolders included) is in the wheel under adaptiveload/_csrc, and
    nothing else is there; every module of the package is in it too."""
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n.removeprefix("adaptiveload/_csrc/") for n in names if n.startswith("adaptiveload/_csrc/")}
    sources = _relative(extension.source_files(tree / "csrc"), tree / "csrc")
    assert any(s.endswith(".cu") for s in sources)
    assert shipped == sources
    modules = _relative((tree / "adaptiveload").rglob("*.py"), tree)
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert not any(n.startswith("csrc/") for n in names)


@pytest.fixture(scope="module")
def found(installed, tmp_path_factory) -> dict:
    """What the installed package reports, run from outside the checkout: its site-packages
    ("purelib"), the extension module's file, source_dir() and the files under it."""
    probe = (
        "import json, sysconfig\n"
        "from adaptiveload.ops import extension\n"
        "src = extension.source_dir()\n"
        "print(json.dumps({'purelib': sysconfig.get_path('purelib'), 'module': extension.__file__, 'src': str(src),\n"
        "                  'files': [p.relative_to(src).as_posix() for p in extension.source_files(src)]}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = _run([installed, "-c", probe], cwd=tmp_path_factory.mktemp("elsewhere"), env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_installed_package_finds_its_sources(found):
    """The installed package (not the checkout) is imported, and its source_dir() is its own
    adaptiveload/_csrc in site-packages, holding every file of csrc/."""
    purelib = Path(found["purelib"])
    assert Path(found["module"]).is_relative_to(purelib), found["module"]
    assert Path(found["src"]) == purelib / "adaptiveload" / "_csrc"
    assert set(found["files"]) == _relative(extension.source_files(ROOT / "csrc"), ROOT / "csrc")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_installed_sources_compile(installed, found):
    """The smallest installed .cu file compiles for sm_90 with the CI flags (.ci/compile_cuda.sh, the
    installed folder as the include path); CI compiles all of csrc/ with the same script."""
    package = Path(found["src"])
    smallest = min(extension.cuda_sources(package), key=lambda p: p.stat().st_size)
    result = _run(["bash", ROOT / ".ci" / "compile_cuda.sh", installed, package, smallest.relative_to(package)])
    assert f"compile_cuda: ok   {smallest}" in result.stdout
