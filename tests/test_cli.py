"""The ``adaptiveload`` command line as a whole (adaptiveload/cli.py, adaptiveload/cliargs.py): one
vocabulary, every default in ``--help``, old spellings noted, bad values named."""
import argparse
import subprocess
import sys

import pytest

import adaptiveload
from adaptiveload.cli import build_parser, main
from adaptiveload.cliargs import choice, deprecated_flag, int_list, non_negative_float, positive_int


def _subparsers(parser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"adaptiveload {adaptiveload.__version__}"


def test_every_default_is_shown_in_help():
    """Each option whose default means something (not None, False or hidden) says it in --help."""
    commands = _subparsers(build_parser())
    assert {"train", "calibrate", "plan", "simulate", "inspect", "build"} <= set(commands)
    for name, parser in commands.items():
        for action in parser._actions:
            if action.default in (None, False, argparse.SUPPRESS) or action.help == argparse.SUPPRESS:
                continue
            shown = parser._get_formatter()._expand_help(action)  # the text --help prints for this option
            assert "(default" in shown, f"{name} {action.option_strings}: default {action.default!r} not shown: {shown!r}"


def test_one_policy_vocabulary_across_commands():
    """train, plan and simulate take the same --policy names."""
    commands = _subparsers(build_parser())
    for name in ("train", "plan", "simulate"):
        text = " ".join(commands[name].format_help().split())
        for value in ("equal_token", "dual", "cost_grouped"):
            assert value in text, (name, value)
        parsed = commands[name].parse_args(["--policy", "cost_grouped", *_required(name)])
        assert parsed.policy in ("cost_grouped", ["cost_grouped"]), name


def _required(name):
    return {"plan": ["--calibration", "x", "--world-size", "2"],
            "simulate": ["--calibration", "x", "--world-size", "2"]}.get(name, [])


@pytest.mark.parametrize("old, new", [("random", "dual"), ("equal-token", "equal_token"),
                                      ("dual-constraint", "dual"), ("cost-grouped", "cost_grouped")])
def test_old_policy_spellings_are_mapped_and_noted(old, new, capsys):
    parse = choice("--policy", ("equal_token", "dual", "cost_grouped"),
                   {"random": "dual", "equal-token": "equal_token", "dual-constraint": "dual",
                    "cost-grouped": "cost_grouped"})
    assert parse(new) == new and capsys.readouterr().err == ""
    assert parse(old) == new
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--policy {old} is deprecated" in err and f"use --policy {new}" in err
    with pytest.raises(argparse.ArgumentTypeError, match="invalid choice 'fast'"):
        parse("fast")


def test_train_sampler_flag_folds_into_policy(capsys):
    """`train --sampler equal` (old) is `--policy equal_token`; `--sampler dual` keeps --policy."""
    train = _subparsers(build_parser())["train"]
    args = train.parse_args(["--sampler", "equal"])
    assert args.sampler == "equal" and "--sampler is deprecated" in capsys.readouterr().err
    assert train.parse_args([]).sampler is None and train.parse_args([]).policy == "dual"
    assert "--sampler" not in train.format_help()


def test_deprecated_flag_stores_into_the_new_dest(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--json", dest="out", action=deprecated_flag("--out"))
    assert parser.parse_args(["--json", "a.json"]).out == "a.json"
    assert capsys.readouterr().err.strip() == (
        "adaptiveload: note: --json is deprecated and will be removed in the next release; use --out")


@pytest.mark.parametrize("parse, good, bad", [
    (positive_int, [("1", 1), ("12", 12)], ["0", "-3", "1.5", "x"]),
    (non_negative_float, [("0", 0.0), ("0.25", 0.25)], ["-1", "nan", "inf", "x"]),
    (int_list, [("1,2,4", [1, 2, 4]), ("8", [8])], ["", "1,0", "a,b"]),
])
def test_argument_types(parse, good, bad):
    for text, value in good:
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


@pytest.mark.parametrize("argv, flag", [
    (["train", "--profile-every", "-1"], "--profile-every"),
    (["train", "--lr", "0"], "--lr"),
    (["train", "--policy", "fastest"], "--policy"),
    (["calibrate", "--warmup", "-2"], "--warmup"),
])
def test_bad_values_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_console_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "adaptiveload", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"adaptiveload {adaptiveload.__version__}"
