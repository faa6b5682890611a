"""Outputs: what happens to a finished record (the printed report, CSV rows, TensorBoard, leak warnings).

Each output is a sink (:mod:`.sinks`) that takes records one by one; the profiler
hands every reported record to each sink in turn, and a sink that fails is switched
off alone. :mod:`.report` formats a record as text, :mod:`.export` writes CSV rows,
:mod:`.tensorboard` sends scalars, :mod:`.leaks` watches for steady growth.

May import the top-level vocabulary (:mod:`~pytorch_mem_profiler.stats`,
:mod:`~pytorch_mem_profiler.units`, :mod:`~pytorch_mem_profiler.faults`); never
torch's device APIs, ``measure``, ``tools`` or ``analysis``.
"""
