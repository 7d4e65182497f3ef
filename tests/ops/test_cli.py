"""``adaptiveload build``: prints the cache folder, or one clear error line without CUDA."""
from __future__ import annotations

import argparse

import pytest
import torch

from adaptiveload.ops import cli as ops_cli
from adaptiveload.ops import extension


def run_build(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="adaptiveload")
    ops_cli.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["build", *argv])
    return args.func(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_build_without_cuda_fails_with_one_clear_line(capsys, monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(extension, "_module", None)
    assert run_build() == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("adaptiveload build: error: cannot build the CUDA kernels:")
    assert "CUDA" in err.split(":", 2)[2] and len(err.splitlines()) == 1


@pytest.mark.cuda
def test_build_prints_the_cache_folder(capsys):
    assert run_build() == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == str(extension.cache_dir())
    assert any(extension.cache_dir().glob("*.so"))
