"""Outputs: what happens to a finished record (the printed report, CSV rows, TensorBoard, warnings).

Each output is a sink (:mod:`.sinks`) that takes records one by one; the profiler
hands every reported record to each sink in turn, and a sink that fails is switched
off alone. :mod:`.report` formats a record as text (full, compact or one line),
:mod:`.export` writes CSV rows as they are reported, :mod:`.tensorboard` sends
scalars, :mod:`.leaks` watches for steady growth, :mod:`.headroom` for a peak near
the device's capacity; :mod:`.notices` issues warnings at the user's line and
:mod:`.progress` writes beside ``tqdm`` bars.

May import the top-level vocabulary (:mod:`~pytorch_mem_profiler.stats`,
:mod:`~pytorch_mem_profiler.units`, :mod:`~pytorch_mem_profiler.faults`,
:mod:`~pytorch_mem_profiler.grouping`); never torch's device APIs, ``measure``,
``tools`` or ``analysis``.
"""
