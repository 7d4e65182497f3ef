"""The step loop and its failure protocol (adaptiveload/train/loop.py)."""
import os

import numpy as np
import pytest
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


def test_kineto_is_silenced_and_the_environment_restored(monkeypatch):
    from adaptiveload.train.loop import silent_kineto

    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    with silent_kineto():
        assert os.environ["KINETO_LOG_LEVEL"] == "6"
    assert "KINETO_LOG_LEVEL" not in os.environ
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")  # the user's own choice wins
    with silent_kineto():
        assert os.environ["KINETO_LOG_LEVEL"] == "2"
    assert os.environ["KINETO_LOG_LEVEL"] == "2"



def test_a_batch_that_cannot_be_loaded_stops_the_step_before_training():
    """A sample file error while fetching: no rank trains (the weights stay), and the message names
    the row and the file (status 5)."""
    from adaptiveload.train.data import SampleError
    from adaptiveload.train.distributed import DistContext
    from adaptiveload.train.loop import one_step

    class Step:
        device = torch.device("cpu")
        module = None
        calls = 0

        def __call__(self, batch, global_samples):
            Step.calls += 1

    def batches():
        raise SampleError("m.csv: row 7: latent file /d/7.pt: no such file")
        yield

    record, failure = one_step(Step(), batches(), DistContext(), 3, profile=False)
    assert record == {} and Step.calls == 0
    assert failure == "step 3: rank 0 could not load its batch: m.csv: row 7: latent file /d/7.pt: no such file"


def test_failure_message_of_a_rank_without_its_batch():
    from adaptiveload.train.loop import failure_message

    nan = float("nan")
    rows = np.array([[0, 1.0, nan, nan, 0, 2, 90, 5, 6, 12], [5, 1.0, nan, nan, 0, 0, 0, 0, 0, 0]])
    assert failure_message(rows, ["", "m.csv: row 2: text file t.pt: no such file"], 0) == \
        "step 0: rank 1 could not load its batch: m.csv: row 2: text file t.pt: no such file"


@pytest.mark.parametrize("backend, inner, version, names, hinted", [
    ("inductor", "inductor", "2.11.0+cu130", "scale_shift_table, blocks.0.scale_shift_table", True),
    ("adaptiveload", "inductor", "2.10.1", "condition_embedder.time_embedder.linear_1.weight", True),
    ("inductor", "inductor", "2.11.0", "time_projection.1.weight", True),
    ("inductor", "inductor", "2.12.0", "time_projection.1.weight", False),  # another release
    ("inductor", "inductor", "2.9.1", "scale_shift_table", False),
    ("adaptiveload", "aot_eager", "2.11.0", "scale_shift_table", False),  # no Inductor
    ("eager", "inductor", "2.11.0", "scale_shift_table", False),
    ("inductor", "inductor", "2.11.0", "blocks.3.ffn.0.weight, head.weight", False),  # other parameters
])
def test_compiler_hint_names_the_inductor_gradient_bug(backend, inner, version, names, hinted):
    from adaptiveload.train.loop import compiler_hint
    from adaptiveload.train.step import StepConfig

    message = (f"warm-up step 0: rank 0 got a non-finite loss or gradient on bucket latent 21x60x104 (S=32,760) with "
               f"B=1 (loss 0.912; non-finite gradients in 2 parameter(s): {names}; the optimizer step was skipped)")
    hint = compiler_hint(StepConfig(backend=backend, inner=inner), message, version)
    assert (hint is not None) == hinted
    if hinted:
        assert "\n" not in hint and "pytorch/pytorch#193061" in hint and version in hint
    assert compiler_hint(StepConfig(backend=backend, inner=inner), "step 0: rank 0 ran out of memory", version) is None
