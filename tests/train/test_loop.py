"""The step loop and its failure protocol (adaptiveload/train/loop.py)."""
import os

import numpy as np
import torch


def test_warm_up_batches_one_per_batch_kind_cheapest_first():
    from adaptiveload.train.loop import warm_up_batches

    keys = np.array([[1, 4, 4], [1, 8, 8], [3, 4, 4]])
    # bucket 0: full batches of 8 and a partial one of 3; bucket 1: B = 1; bucket 2: B = 2 and 1.
    # B * T*H*W: 8*16 = 128, 3*16 = 48, 1*64 = 64, 2*48 = 96, 1*48 = 48 (ties by (B, shape))
    kinds = np.array([[0, 8], [0, 3], [1, 1], [2, 2], [2, 1]])
    assert warm_up_batches(keys, kinds) == [(1, (3, 4, 4)), (3, (1, 4, 4)), (1, (1, 8, 8)), (2, (3, 4, 4)), (8, (1, 4, 4))]
    assert warm_up_batches(keys, np.zeros((0, 2), dtype=np.int64)) == []


def test_a_step_that_compiles_is_flagged():
    """one_step flags a step during which Dynamo compiled a graph (its time counts in tokens/s): the
    first call of a compiled function at a new shape class compiles, the same shape again does not."""
    from types import SimpleNamespace

    from adaptiveload.train.data import Batch
    from adaptiveload.train.distributed import DistContext
    from adaptiveload.train.loop import one_step

    torch._dynamo.reset()
    square_sum = torch.compile(lambda x: (x * x).sum(), backend="eager", dynamic=False)

    class Step:  # the parts of TrainStep that one_step uses
        device = torch.device("cpu")
        module = SimpleNamespace(config=SimpleNamespace(patch_size=(1, 1, 1)))
        optimizer = None

        def __call__(self, batch, global_samples):
            return square_sum(batch.latents) / global_samples

        def synchronize(self):
            pass

    def batch(b, t):
        latents = torch.ones(b, 1, t, 2, 2)
        return Batch(torch.arange(b), latents, torch.zeros(b, 1, 1), latents, torch.zeros(b))

    batches = iter([batch(2, 3), batch(2, 3), batch(2, 5)])
    flags = [one_step(Step(), batches, DistContext(), i, profile=False)[0]["compiled"] for i in range(3)]
    assert flags == [True, False, True]  # static shapes: a new T compiles again


def test_failure_message_reads_each_rank_row():
    """The per-step row (columns: StepRow) of each failing rank becomes its bucket shape, S and B;
    a rank with status 0 is left out; OOM and non-finite add their advice."""
    from adaptiveload.train.loop import failure_message

    nan = float("nan")
    rows = np.array([  # status, wall, busy, loss, compiled, B, S, T, H, W
        [1, 2.0, nan, nan, 0, 3, 32760, 21, 60, 104],
        [0, 2.0, nan, 1.5, 0, 8, 1560, 1, 60, 104],
        [4, 2.0, nan, 3.9, 1, 1, 75600, 21, 90, 160],
    ])
    text = failure_message(rows, ["CUDA out of memory", "", "loss 3.9"], 7)
    assert text.startswith("step 7: rank 0 ran out of memory on bucket latent 21x60x104 (S=32,760) with B=3 "
                           "(CUDA out of memory); rank 2 got a non-finite loss or gradient on bucket latent "
                           "21x90x160 (S=75,600) with B=1 (loss 3.9)")
    assert "rank 1" not in text
    assert "compare the same bucket under --backend eager" in text and "recalibrate with a smaller memory budget" in text


def test_quiet_silences_kineto_and_restores_the_environment(monkeypatch):
    from adaptiveload.train.loop import quiet_profiler

    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    with quiet_profiler(True):
        assert os.environ["KINETO_LOG_LEVEL"] == "6"
    assert "KINETO_LOG_LEVEL" not in os.environ
    with quiet_profiler(False):
        assert "KINETO_LOG_LEVEL" not in os.environ
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")  # the user's own choice wins
    with quiet_profiler(True):
        assert os.environ["KINETO_LOG_LEVEL"] == "2"
    assert os.environ["KINETO_LOG_LEVEL"] == "2"
