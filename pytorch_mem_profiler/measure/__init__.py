"""Measuring: every read of a device's memory, and what an iteration is made of.

Four kinds of parts, each knowing only those below it:

- *readers*, stateless, the only code that calls a device memory API (``torch.cuda``,
  ``torch.xpu``, ``torch.mps``, ``torch.accelerator``, NVML): :mod:`.devices` (counters,
  device resolution, capacity; on the CPU through the one dispatch mode of
  :mod:`.storage_counting`), :mod:`.allocator` (the caching allocator's statistics, its
  history recording and out-of-memory observer), :mod:`.outside` (memory outside
  PyTorch); beside them :mod:`.accounting` counts bytes of models and optimizers from
  their tensors. They know nothing of iterations;
- the *hook set*, :mod:`.hooks` (with :mod:`.entries`, the modules a forward enters the
  model through): it installs, removes, sleeps and wakes torch's hooks and turns what
  they see into events;
- the *phase machine*, :mod:`.phases`, no torch in it: from those events it decides
  where the iteration is (forward, backward, the optimizer step), counts passes and
  steps, reads the counters at each boundary of a watched iteration and hands the
  events on to the *observers* (:mod:`.observers`): :mod:`.intervals` (phase peaks,
  the iteration's peak, feature maps, gradients), :mod:`.peak_breakdown` (what is
  alive at the peak), :mod:`.layers` (feature maps by layer; :mod:`.saved_tensors`
  chains its pack hook to the user's) and :mod:`.data_parallel` (DDP's buckets,
  FSDP2's gathered parameters). Each observer returns its own part of the record;
- the *meter*, :mod:`.meter`: it wires them, hands each iteration an immutable
  :class:`~.plan.IterationPlan` (:mod:`.plan`; the level :mod:`.budget` chose, the
  observers on, from :mod:`.observer_set`, which holds the observers and their plans)
  and builds the :class:`~pytorch_mem_profiler.stats.IterationRecord` from the parts
  and the model's sizes (:mod:`.model_state`, counted once per change of the model).

A new measurement is a new observer, as a new output is a new sink
(:mod:`pytorch_mem_profiler.outputs.sinks`). ``tests/test_architecture.py`` holds
the shape: device calls in the readers only, no torch in the machine, observers
importing no hook module, no object setting another's fields.

May import torch, the top-level vocabulary (:mod:`~pytorch_mem_profiler.stats`,
:mod:`~pytorch_mem_profiler.units`, :mod:`~pytorch_mem_profiler.faults`) and each
other; never ``outputs``, ``tools``, ``analysis`` or pandas.
"""
