"""The profiler under torch.distributed on one GPU: a one-rank NCCL group, FSDP2.

The two-GPU tests are in ``test_distributed_cuda.py``. Run with
``PYTHONPATH=. python3 -m pytest -m cuda -q tests/test_distributed_one_gpu_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from .test_distributed import fsdp_sampling_with_a_fault

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA GPU and NCCL"),
]


@pytest.fixture
def one_gpu_group():
    """A real NCCL process group of one rank on GPU 0, torn down after the test."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


def test_fsdp_gathered_parameters_on_a_gpu_and_a_fault_takes_the_hooks_off(one_gpu_group, stream, monkeypatch):
    fsdp_sampling_with_a_fault(one_gpu_group, monkeypatch, stream)
