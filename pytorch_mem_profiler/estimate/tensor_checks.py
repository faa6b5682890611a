"""A library's check on tensor values the fake step does not have: taken as passing, and noted.

Libraries check their inputs with ``torch._check_tensor_all_with(error_type, cond, message)``
(transformers' ``torch_check``: a vision-language model checks that its image tokens match the
image features it scatters into them, ``special_image_mask.sum() == image_features.numel()``). A
check reads its condition's value (``.item()``), which a fake tensor computed from the data (token
ids drawn at random) does not have, and the estimate was refused at that line; so were
``torch.distributions``' checks of their arguments and samples (``if not torch._is_all_true(valid)``:
a probabilistic forecaster's Student-t head, an actor's Normal policy). A check decides only
whether the step raises: a step that runs passes it, and allocates what it allocates whatever the
values. For the length of the fake step, :func:`checks_taken_as_passing` lets a check whose
condition has no value pass and notes its line (the estimate reports them); a condition with a
value (a real tensor, or a fake one the step knows) is checked as torch checks it, failing as the
real step fails.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> with fake_mode(), checks_taken_as_passing() as taken:
    ...     data = torch.empty(4)                               # no values
    ...     torch._check_tensor_all(data > 0)                   # cannot be read: taken as passing
    >>> sum(taken.values())
    1
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .draws import user_line

__all__ = ["checks_taken_as_passing"]


def _unknown(cond: Any) -> bool:
    return isinstance(cond, FakeTensor) and getattr(cond, "constant", None) is None


@contextlib.contextmanager
def checks_taken_as_passing() -> Iterator[dict[str, int]]:
    """Patch ``torch._check_tensor_all_with``, ``torch._check_tensor_all`` and ``torch._is_all_true``
    (which ``torch.distributions`` validates its arguments and samples with) for the fake step; yields
    the lines of the checks taken as passing, with how often each ran."""
    taken: dict[str, int] = {}
    with_error, plain, is_all_true = torch._check_tensor_all_with, torch._check_tensor_all, torch._is_all_true

    def note() -> None:
        # the line that asked for the check, past a library's own checking helpers (transformers'
        # torch_check): the model's line is what a reader can act on
        frames = traceback.extract_stack()
        frames = [f for f in frames if "check" not in f.name] or frames
        line = user_line(frames) or "torch._check_tensor_all"
        taken[line] = taken.get(line, 0) + 1

    def check_with(error_type: Any, cond: Any, message: Any = None) -> None:
        if _unknown(cond):
            note()
            return
        with_error(error_type, cond, message)

    def check(cond: Any, message: Any = None) -> None:
        if _unknown(cond):
            note()
            return
        plain(cond, message)

    def all_true(tensor: Any) -> Any:
        # ``if not torch._is_all_true(valid): raise ...``: torch.distributions' argument and sample
        # validation (on by default), read by ``bool()``; Python's True where the values are unknown
        # (a tensor, even a real one, would be read through the fake mode)
        if _unknown(tensor):
            note()
            return True
        return is_all_true(tensor)

    torch._check_tensor_all_with, torch._check_tensor_all, torch._is_all_true = check_with, check, all_true
    try:
        yield taken
    finally:
        torch._check_tensor_all_with, torch._check_tensor_all, torch._is_all_true = with_error, plain, is_all_true
