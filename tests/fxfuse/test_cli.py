"""``adaptiveload inspect`` (adaptiveload/fxfuse/cli.py)."""
from __future__ import annotations

import argparse
import textwrap

import pytest

from adaptiveload.fxfuse import cli

FACTORIES = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    D = 16

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D, elementwise_affine=False)
            self.ada = nn.Linear(D, 2 * D)

        def forward(self, x, c):
            shift, scale = self.ada(c).chunk(2, dim=1)
            y = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
            z = F.layer_norm(y, (D,)) * scale[:, None] + shift[:, None]
            return F.rms_norm(z, (D,)) * (1 + scale[:, None])

    def with_inputs():
        return Block(), (torch.randn(2, 5, D), torch.randn(2, D))

    def with_kwargs():
        return Block(), {"x": torch.randn(2, 5, D), "c": torch.randn(2, D)}

    def module_only():
        return Block()

    def no_chains():
        return nn.Linear(D, D), (torch.randn(2, D),)

    def not_a_module():
        return 42

    NOT_CALLABLE = 3
    """
)


UNSCALED = "multiplier is not `1 + scale` (the op computes norm * (1 + scale))"


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(FACTORIES)
    return path


def _run(*argv) -> int:
    parser = argparse.ArgumentParser(prog="adaptiveload")
    cli.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["inspect", *argv])
    return args.func(args)


@pytest.mark.parametrize("factory", ["with_inputs", "with_kwargs"])
def test_prints_the_table_of_chains(factory_file, factory, capsys):
    assert _run(f"{factory_file}:{factory}") == 0
    out = capsys.readouterr().out
    assert "Dynamo captured 1 graph(s)" in out
    assert "norm*(1+scale)+shift  per-sample            fused" in out
    assert f"skipped: {UNSCALED}" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [(r[1], r[4]) for r in rows] == [("adaln_modulate", "F.layer_norm"), ("adaln_modulate", "F.layer_norm"),
                                            ("rms_norm_modulate", "F.rms_norm")]
    assert out.rstrip().endswith(f"total: fused 2 chains (3 seen, 1 skipped: 1× {UNSCALED}) "
                                 "[fused/seen: adaln_modulate 1/2, rms_norm_modulate 1/1]")


def test_prints_the_summary_without_chains_too(factory_file, capsys):
    assert _run(f"{factory_file}:no_chains") == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("total: fused 0 chains (0 seen, 0 skipped)")


def test_module_factory_with_input_shapes_and_dtype(factory_file, capsys):
    assert _run(f"{factory_file}:module_only", "--input-shapes", "2,7,16; 2,16", "--dtype", "bfloat16") == 0
    assert "fused 2 chains" in capsys.readouterr().out


def test_dotted_module_path_from_the_current_directory(factory_file, monkeypatch, capsys):
    monkeypatch.chdir(factory_file.parent)
    monkeypatch.syspath_prepend(str(factory_file.parent))
    assert _run("user_model:with_inputs") == 0
    assert "total: fused 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "target, extra, message",
    [
        ("no_colon_here", [], "expected MODULE:FACTORY"),
        (":build", [], "expected MODULE:FACTORY"),
        ("surely_missing_module_xyz:build", [], "cannot import module 'surely_missing_module_xyz'"),
        ("{file}:missing", [], "has no attribute 'missing'"),
        ("{file}:NOT_CALLABLE", [], "is a int, not a callable factory"),
        ("{file}:not_a_module", [], "returned int: expected an nn.Module or (module, inputs)"),
        ("{file}:module_only", [], "returned a module without inputs: give --input-shapes"),
        ("{file}:module_only", ["--input-shapes", "2,x,16"], "tensor 1 '2,x,16' is not comma-separated positive ints"),
        ("{file}:module_only", ["--input-shapes", "2,5,16;0,16"], "tensor 2 '0,16'"),
        ("missing_dir/model.py:build", [], "no such file: missing_dir/model.py"),
        ("{file}:module_only", ["--input-shapes", "2,5,16"],
         "failed on inputs (shape [2, 5, 16]): TypeError: Block.forward() missing 1 required positional argument: 'c'"),
    ],
)
def test_bad_input_gets_a_clear_error(factory_file, target, extra, message):
    with pytest.raises(ValueError) as err:
        _run(target.format(file=factory_file), *extra)
    assert message in str(err.value)


def test_main_prints_one_line_errors(capsys):
    from adaptiveload import cli as main_cli

    assert main_cli.main(["inspect", "no_colon_here"]) == 2
    assert capsys.readouterr().err.strip() == (
        "adaptiveload inspect: error: expected MODULE:FACTORY (e.g. mypkg.models:build or model.py:build), "
        "got 'no_colon_here'"
    )
