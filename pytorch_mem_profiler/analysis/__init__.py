"""Analysis of written runs: reading CSV files back, the summary, what was alive at the peak,
comparisons, plots, the HTML report and the command line.

Works on files alone, so nothing here imports torch: ``pytorch-mem-profiler summary``
starts without it. pandas is imported here (and by ``outputs.export``'s reader-facing
column lists); matplotlib only by :mod:`.plot`, lazily.

May import pandas, ``outputs`` (column names, the report's formatting) and the
top-level vocabulary (:mod:`~pytorch_mem_profiler.stats`, :mod:`~pytorch_mem_profiler.units`).
"""
