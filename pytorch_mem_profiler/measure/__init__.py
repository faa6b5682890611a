"""Measuring: every read of a device's memory, and the hooks that find an iteration's phases.

The only subpackage that calls a device memory API (``torch.cuda``, ``torch.xpu``,
``torch.mps``, ``torch.accelerator``, NVML): :mod:`.devices` (counters, device
resolution, capacity; on the CPU through the one dispatch mode of
:mod:`.storage_counting`), :mod:`.allocator` (the caching allocator's statistics, its
history recording and out-of-memory observer), :mod:`.outside` (memory outside
PyTorch). :mod:`.accounting` counts bytes of models and optimizers from their
tensors, :mod:`.hooks` finds forward, backward and the optimizer step (with
:mod:`.entries`, the modules a forward enters the model through),
:mod:`.layers` puts saved tensors down to modules (:mod:`.saved_tensors` chains
its pack hook to the user's saved-tensor hooks), :mod:`.data_parallel` knows DDP
and FSDP2, and :mod:`.meter` owns one iteration's state and turns it into an
:class:`~pytorch_mem_profiler.stats.IterationRecord`.

May import torch, the top-level vocabulary (:mod:`~pytorch_mem_profiler.stats`,
:mod:`~pytorch_mem_profiler.units`, :mod:`~pytorch_mem_profiler.faults`) and each
other; never ``outputs``, ``tools``, ``analysis`` or pandas.
"""
