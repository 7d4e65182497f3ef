"""The ``Example::`` outputs in adaptiveload.sched docstrings are real: run them as doctests."""
import doctest
import importlib

import pytest

MODULES = ["shapes", "batch_size", "cost_model", "memory_model", "manifest", "calibration", "presets", "plan",
           "sampler", "simulate", "cli"]


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    module = importlib.import_module(f"adaptiveload.sched.{name}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
