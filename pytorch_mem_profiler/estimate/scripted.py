"""TorchScript functions a model calls, run as Python while the estimate's fake step runs.

A function decorated with ``torch.jit.script`` (transformers' DeBERTa-v2 builds its relative
positions so, on the releases before 5) runs in TorchScript's interpreter. After a couple of
calls its profiling executor may fuse the graph into a generated kernel (the TensorExpr fuser on
CUDA) that reads the tensors' memory directly, past the dispatcher: on fake tensors, which have no
memory, a fused CUDA kernel reads made-up addresses and leaves the CUDA context broken ("an
illegal memory access was encountered"), for the rest of the process.

:func:`scripted_as_python` puts back, for the length of the step, the Python function each
scripted one was made from (``torch.jit.script`` keeps it as ``_torchdynamo_inline``) in the
namespaces of the modules that define the model's layers, and turns TorchScript's CUDA fuser
(TensorExpr) off for any it could not put back. The model's code then runs op by op under the fake mode. Only fake CUDA tensors
need it (TorchScript fuses nothing on the CPU by default): there the script runs under the fake
mode as it runs for real, and the CPU estimate stays exact. On CUDA the Python function frees its
intermediates when it returns, where the interpreter frees each as soon as it is dead: a step can
hold a little more than the scripted one (bytes of the function's own temporaries), never a
broken context.

Example::

    >>> import torch
    >>> from torch import nn
    >>> import types, sys
    >>> space = types.ModuleType("scripted_example"); sys.modules["scripted_example"] = space
    >>> def double(x: torch.Tensor) -> torch.Tensor:
    ...     return x * 2
    >>> space.double = torch.jit.script(double)
    >>> Layer = type("Layer", (nn.Module,), {"__module__": "scripted_example"})
    >>> with scripted_as_python(Layer()):
    ...     space.double is double
    True
    >>> isinstance(space.double, torch.jit.ScriptFunction)  # put back after the block
    True
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["scripted_as_python"]


def _namespaces(model: nn.Module) -> list[dict[str, Any]]:
    """The globals of every Python module that defines a class of the model's layers (with their bases)."""
    names: dict[str, None] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__ and not cls.__module__.startswith("torch."):
                names[cls.__module__] = None
    found = []
    for name in names:
        space = sys.modules.get(name)
        if space is not None and isinstance(getattr(space, "__dict__", None), dict):
            found.append(space.__dict__)
    return found


@contextlib.contextmanager
def scripted_as_python(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """For the ``with`` block: the model's modules' scripted functions as their Python originals,
    and TorchScript's fusion off (see the module); nothing where ``enabled`` is false."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    script_function = getattr(torch.jit, "ScriptFunction", None)
    if not enabled:
        yield
        return
    if script_function is not None:
        for space in _namespaces(model):
            for name, value in list(space.items()):
                original = getattr(value, "_torchdynamo_inline", None) if isinstance(value, script_function) else None
                if callable(original):
                    swapped.append((space, name, value))
                    space[name] = original
    # TorchScript's CUDA fuser off for scripted code not put back (``torch.jit.fuser("none")``
    # would do it too, with a warning per call on releases without nvfuser)
    enabled = getattr(torch._C, "_jit_texpr_fuser_enabled", None)
    set_enabled = getattr(torch._C, "_jit_set_texpr_fuser_enabled", None)
    was = enabled() if enabled is not None and set_enabled is not None else None
    try:
        if was:
            set_enabled(False)
        yield
    finally:
        if was:
            set_enabled(True)
        for space, name, value in swapped:
            space[name] = value
