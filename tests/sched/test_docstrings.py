"""Every module of adaptiveload.sched has ``Example::`` outputs in its docstrings, and they are real:
run them as doctests. Every public class, function and method has a docstring."""
import doctest
import importlib
import inspect
import pkgutil

import pytest

import adaptiveload.sched

# found, not listed: a new module is checked without editing this file
MODULES = sorted(info.name for info in pkgutil.iter_modules(adaptiveload.sched.__path__))


def test_every_module_is_found():
    assert {"cost_model", "calibration", "cli", "plan", "policies", "sampler", "simulate"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    module = importlib.import_module(f"adaptiveload.sched.{name}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"adaptiveload.sched.{name} has no Example:: to run"
    assert result.failed == 0


def _public(module):
    """(qualified name, object) of every public class and function defined in ``module``, and of the
    public methods and properties its classes define."""
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield name, obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                member = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(member):
                    yield f"{name}.{attr}", member


@pytest.mark.parametrize("name", MODULES)
def test_public_docstrings(name):
    module = importlib.import_module(f"adaptiveload.sched.{name}")
    assert inspect.getdoc(module), f"adaptiveload.sched.{name} has no module docstring"
    # inspect.getdoc inherits an overriding method's docstring from the base class (CostModel.intercept ...)
    missing = [qual for qual, obj in _public(module) if not inspect.getdoc(obj)]
    assert missing == [], f"public names without a docstring in adaptiveload.sched.{name}: {missing}"
