"""``benchmarks/zoo_sweep.py``'s checks on the sweep's plain-torch models (the others need transformers,
timm and torchvision, and take the sweep's own run: ``python benchmarks/zoo_sweep.py``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.zoo.sweep import SWEEP
from benchmarks.zoo_sweep import CHECKS, main

PLAIN = [name for name, entry in SWEEP.items() if not entry.needs]
ESTIMATES = ("estimate", "swapped", "checkpointing", "largest_batch")
#: the plain-torch models that run an FFT (``torch.stft``; ``rfft2`` and ``irfft2``)
FFT = ("spectrogram", "fourier_operator")


def _fake_fft_runs() -> bool:
    """Whether this torch's fake mode runs an FFT on the CPU (torch 2.4 has no fake kernel for it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException

    try:
        with FakeTensorMode(allow_fallback_kernels=False):  # as the estimate's mode: no real kernel run
            torch.fft.rfft(torch.empty(8))
    except UnsupportedOperatorException:
        return False
    return True


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_sweeps_plain_torch_models_pass_every_check(name, check):
    if name in FFT and check in ESTIMATES and not _fake_fft_runs():
        from pytorch_mem_profiler.estimate import EstimateUnsupported

        with pytest.raises(EstimateUnsupported, match=r"aten\._fft_r2c"):  # refused, naming the operator
            CHECKS[check](SWEEP[name])
        return
    CHECKS[check](SWEEP[name])


def test_the_sweep_reports_a_failing_check_and_goes_on(monkeypatch, capsys):
    def fails(entry):
        raise AssertionError("off by 4 B")

    monkeypatch.setitem(CHECKS, "estimate", fails)
    assert main(["--only", "tcn", "unfold_fold", "--checks", "estimate", "record"]) == 1
    out = capsys.readouterr().out
    assert out.count("estimate FAILED: AssertionError: off by 4 B") == 2 and out.count("record ok") == 2
    assert "2 check(s) failed" in out
