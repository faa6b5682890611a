"""fp16 loss scaling (``torch.amp.GradScaler``) in the estimate's step, as a training loop runs it.

Training under float16 autocast scales the loss so that small gradients do not underflow
(Lightning's ``precision="16-mixed"``, the Hugging Face Trainer's ``fp16=True``)::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # only where the gradients are clipped
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(optimizer)
    scaler.update()

What it allocates is small but real, and its own: the scale and the growth counter (made at the
first ``scale``, kept for the run), the scaled loss, and at each step the unscaling's found-inf
flags and inverse scale. ``scaler.step`` reads the flags back (``found_inf.item()``) and skips
the optimizer's step where a gradient was infinite: a value the fake step does not have. A step
that skips the optimizer allocates less than one that runs it, so the estimate takes the
gradients as finite (:class:`FiniteGradScaler`): the step that runs the optimizer, as every step
of a healthy run does. Fused optimizers that unscale inside their own kernel
(``Adam(fused=True)``) read no flag: ``scaler.step`` hands them the scale as it does for real.

Example::

    >>> import torch
    >>> scaler = FiniteGradScaler("cpu")
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> opt = torch.optim.SGD([p], lr=0.1)
    >>> scaler.scale((p * 2).sum()).backward()
    >>> scaler.step(opt); scaler.update()
    >>> scaler.steps_taken_as_finite, p.detach().tolist()
    (1, [0.800000011920929, 0.800000011920929, 0.800000011920929])
"""

from __future__ import annotations

from typing import Any

import torch


class FiniteGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose ``step`` takes the gradients as finite (see the module's docstring);
    everything else, what it allocates included, is torch's own. ``device``: the fake step's tensors'
    (``"cpu"`` where the CPU stands in for a GPU, whose scaler would switch itself off without one)."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        #: how many optimizer steps ran without the found-inf flags being read
        self.steps_taken_as_finite = 0

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        # torch: ``if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values())``
        self.steps_taken_as_finite += 1
        return optimizer.step(*args, **kwargs)


def grad_scaler_note(scaler: FiniteGradScaler | None) -> tuple[str, ...]:
    """The report's note on the flags ``scaler.step`` did not read (none where it read none)."""
    if scaler is None or not scaler.steps_taken_as_finite:
        return ()
    return (
        "GradScaler.step reads whether a gradient was infinite, a value the estimate does not have: the "
        "gradients were taken as finite, so the optimizer's step runs (a step it skips allocates less)",
    )
