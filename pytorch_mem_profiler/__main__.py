"""``python -m pytorch_mem_profiler``: the command line (see :mod:`pytorch_mem_profiler.analysis.cli`)."""

from .analysis.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
