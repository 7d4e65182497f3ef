"""Helpers for the train tests: run the CLI or a script in fresh processes (one, or two under torchrun),
and write a small on-disk dataset (tiny_dataset.py)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env() -> dict:
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))  # faulty_model.py lives here
    env["PYTHONPATH"] = os.pathsep.join([REPO, here, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd, timeout):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)
    return proc


@pytest.fixture
def run_cli():
    """``run_cli(*args, nproc=1, timeout=...)`` -> CompletedProcess of ``adaptiveload ARGS`` (torchrun when nproc > 1)."""

    def run(*args, nproc: int = 1, timeout: float = 240):
        if nproc == 1:
            cmd = [sys.executable, "-m", "adaptiveload", *map(str, args)]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "adaptiveload", *map(str, args)]
        return _run(cmd, timeout)

    return run


@pytest.fixture
def run_script():
    """``run_script(path, *args, nproc=2, timeout=...)`` -> CompletedProcess of a Python script under torchrun."""

    def run(path, *args, nproc: int = 2, timeout: float = 240):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(path), *map(str, args)]
        return _run(cmd, timeout)

    return run


@pytest.fixture
def tiny_dataset():
    """``tiny_dataset(folder, shapes, samples, **options)`` -> the manifest's path
    (:func:`write_tiny_dataset` of tests/train/tiny_dataset.py)."""
    spec = importlib.util.spec_from_file_location("tiny_dataset", os.path.join(os.path.dirname(__file__),
                                                                                "tiny_dataset.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_tiny_dataset


def _model_tensors(run_dir):
    """The model weights of a run's newest checkpoint, loaded without a process group."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = run_dir / "checkpoint" / (run_dir / "checkpoint" / "latest").read_text().strip()
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(path))
    return state


@pytest.fixture
def checkpoint_weights():
    """``checkpoint_weights(run_dir)`` -> {"model.NAME": tensor}: the model weights of the run's newest
    checkpoint (``run_dir/checkpoint/latest``), loaded without a process group."""
    return _model_tensors
