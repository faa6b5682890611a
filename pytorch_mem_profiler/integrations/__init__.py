"""Integrations with training frameworks, each a thin adapter over the profiler's public API.

Each module imports its framework lazily, so none is a dependency of the package.
"""
