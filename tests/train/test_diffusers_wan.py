"""diffusers' WanTransformer3DModel through the --model factory interface and the training step."""
import pytest
import torch

pytest.importorskip("diffusers")

from adaptiveload.train.data import synthetic_batch  # noqa: E402
from adaptiveload.train.diffusers_wan import DiffusersWan  # noqa: E402
from adaptiveload.train.distributed import DistContext  # noqa: E402
from adaptiveload.train.setup import resolve_activation_checkpointing  # noqa: E402
from adaptiveload.train.step import InputSpec, StepConfig, TrainStep  # noqa: E402

SMALL = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2, in_channels=4, out_channels=4,
             text_dim=32)


def test_wrapper_trains_with_the_shared_step():
    torch.manual_seed(0)
    model = DiffusersWan(**SMALL)
    model.config.text_len = 8
    spec = InputSpec.from_model(model)
    assert spec == InputSpec(in_channels=4, text_len=8, text_dim=32, patch_size=(1, 2, 2))
    assert model.config.dim == 32 and len(model.blocks) == 2
    batch = synthetic_batch(spec, 2, (3, 6, 8))
    out = model(batch.latents, 1000 * batch.sigma, batch.context)
    assert out.shape == batch.latents.shape
    step = TrainStep(model, StepConfig(backend="eager", learning_rate=1e-2), DistContext())
    first = float(step(batch, 2))
    for _ in range(5):
        step(batch, 2)
    assert float(step.forward_backward(batch, 2)) < first  # it learns the batch


def test_activation_checkpointing_of_the_diffusers_blocks_keeps_gradients():
    """The step checkpoints diffusers' blocks itself (diffusers' own switch stays off): fewer saved
    tensors, the same gradients."""
    assert resolve_activation_checkpointing("on", DiffusersWan(**SMALL), 100, torch.device("cpu")) is True
    assert resolve_activation_checkpointing("off", DiffusersWan(**SMALL), 100, torch.device("cpu")) is False
    grads, saved = {}, {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = DiffusersWan(**SMALL)
        model.config.text_len = 8
        step = TrainStep(model, StepConfig(backend="eager", activation_checkpointing=checkpointed), DistContext())
        assert not model.inner.is_gradient_checkpointing
        batch = synthetic_batch(InputSpec.from_model(model), 2, (3, 6, 8))
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
            step.forward_backward(batch, 2)
        saved[checkpointed] = len(packed)
        grads[checkpointed] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert saved[True] < saved[False]
    assert grads[True].keys() == grads[False].keys() and grads[False]
    for name, ref in grads[False].items():
        torch.testing.assert_close(grads[True][name], ref, rtol=1e-5, atol=1e-7, msg=name)
