"""``pad_packed_sequence`` for fake data: ATen's loop, written with the operators it runs.

``nn.utils.rnn.pack_padded_sequence`` packs a padded batch into the rows that hold tokens, and
``batch_sizes``, how many sequences are still running at each step, a host tensor the recurrent
layer and ``pad_packed_sequence`` read. The estimate packs with the lengths' values where the step
has them (:mod:`.lengths`: a lengths tensor the user gave, kept with its values), so ``batch_sizes``
is a real host tensor there. ``pad_packed_sequence``'s ATen kernel (``_pad_packed_sequence``, a
composite) writes the lengths it returns through a pointer into a tensor it makes: made fake in
the fake mode, it has no memory to write. For the length of the fake step, :func:`padded_as_aten_does`
runs that kernel's own steps instead when the data is fake and ``batch_sizes`` real: the output
filled with the padding value, ``(steps, batch, *features)``, each run of steps with the same
number of sequences copied in from a slice of the data, transposed for ``batch_first``; the
lengths a real host tensor. The same operators, so the same memory forward and backward.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> mode = fake_mode()
    >>> with mode, mode.draws.on(), padded_as_aten_does():
    ...     packed = nn.utils.rnn.pack_padded_sequence(torch.empty(3, 5, 8), torch.tensor([5, 2, 4]), batch_first=True, enforce_sorted=False)
    ...     padded, lengths = nn.utils.rnn.pad_packed_sequence(packed, batch_first=True)
    >>> tuple(padded.shape), lengths.tolist()
    ((3, 5, 8), [5, 2, 4])
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .lengths import known_values

__all__ = ["padded_as_aten_does"]


def _pad_packed(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float, total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's ``_pad_packed_sequence`` (``PackedSequence.cpp``), step for step."""
    sizes = known_values(batch_sizes)
    assert sizes is not None  # a real host tensor: the caller checks
    longest = len(sizes)
    if total_length > 0 and total_length < longest:
        raise RuntimeError(
            f"Expected total_length to be at least the length of the longest sequence in input, but got "
            f"total_length={total_length} and max sequence length being {longest}"
        )
    batch = sizes[0]
    steps = total_length if total_length > 0 else longest
    output = torch.full((steps, batch, *data.shape[1:]), padding_value, dtype=data.dtype, device=data.device)
    lengths = [0] * batch
    offset, previous_batch, previous_step = 0, batch, 0
    for step in range(longest + 1):
        running = sizes[step] if step != longest else 0
        if running != previous_batch:
            rows = previous_batch * (step - previous_step)
            piece = data.narrow(0, offset, rows).view(step - previous_step, previous_batch, *data.shape[1:])
            output.narrow(0, previous_step, step - previous_step).narrow(1, 0, previous_batch).copy_(piece)
            offset += rows
            previous_step = step
        for j in range(running, previous_batch):
            lengths[j] = step
        previous_batch = running
    if batch_first:
        output = output.transpose(0, 1)
    # made as the step makes a host tensor from numbers: with its values while the step runs
    return output, torch.tensor(lengths, dtype=torch.int64)


@contextlib.contextmanager
def padded_as_aten_does() -> Iterator[None]:
    """For the fake step: ``torch._VF._pad_packed_sequence`` of fake data with a real ``batch_sizes``
    runs :func:`_pad_packed`; any other call runs torch's own."""
    vf = torch._VF
    original = vf.__dict__.get("_pad_packed_sequence")

    def pad_packed(data: Any, batch_sizes: Any, batch_first: bool, padding_value: float, total_length: int) -> Any:
        if isinstance(data, FakeTensor) and isinstance(batch_sizes, torch.Tensor) and not isinstance(batch_sizes, FakeTensor):
            return _pad_packed(data, batch_sizes, batch_first, padding_value, total_length)
        return torch._C._VariableFunctions._pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)

    vf._pad_packed_sequence = pad_packed  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if original is None:
            del vf._pad_packed_sequence  # type: ignore[attr-defined]
        else:
            vf._pad_packed_sequence = original  # type: ignore[attr-defined]
