"""The values a user gave the step's inputs (a mask of ones, positions) go with them to the
estimated device (``estimate.fake.fake_inputs``, ``Draws.placed``): on the CPU as before, and on a
GPU, where they are kept on the CPU beside the fake tensors (no GPU memory, no GPU needed to make
them). The GPU side, against a real step, is ``tests/test_estimate_device_values_cuda.py``."""

from __future__ import annotations

import pytest
import torch

from pytorch_mem_profiler.estimate.fake import fake_inputs, fake_mode

# a fake CUDA tensor is made without a GPU (no runtime call), as tests/test_estimate_draws.py's are
CUDA = torch.device("cuda", 0)


def _batch(batch: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 100, (batch, 8)), "attention_mask": torch.ones(batch, 8, dtype=torch.long)}


@pytest.mark.parametrize("given", ["function", "template"])
def test_a_mask_of_ones_keeps_its_value_on_a_gpu(given):
    mode = fake_mode()
    example = _batch if given == "function" else _batch(2)
    with mode:
        made = fake_inputs(example, 3, CUDA, mode)
        mask, ids = made["attention_mask"], made["input_ids"]
        read = bool(mask.all())  # read as transformers reads it, from the value
    assert read
    assert mask.device == CUDA and tuple(mask.shape) == (3, 8)
    assert mask.constant is not None and mask.constant.device.type == "cpu"
    assert torch.equal(mask.constant, torch.ones(3, 8, dtype=torch.long))
    if given == "function":
        assert ids.constant is None  # drawn at random inside the estimate: data it does not have
    else:  # the template's own token ids, the user's, its rows repeated
        assert torch.equal(ids.constant, example["input_ids"][[0, 1, 0]])


def test_a_template_keeps_its_rows_on_a_gpu():
    mode = fake_mode()
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]])
    with mode:
        made = fake_inputs((torch.randn(2, 4), positions), 4, CUDA, mode)
    assert made[0].constant is None
    assert torch.equal(made[1].constant, positions[[0, 1, 0, 1]])


def test_without_the_mode_or_with_floats_nothing_is_kept():
    mode = fake_mode()
    with mode:
        plain = fake_inputs(_batch(2), 2, CUDA)
        floats = fake_inputs(torch.randn(2, 4), 2, CUDA, mode)
    assert plain["attention_mask"].constant is None
    assert floats.constant is None


def test_on_the_cpu_the_values_are_kept_as_before():
    mode = fake_mode()
    with mode:
        made = fake_inputs(_batch, 2, torch.device("cpu"), mode)
    assert torch.equal(made["attention_mask"].constant, torch.ones(2, 8, dtype=torch.long))
