"""On CUDA: a forward that replaces a buffer frees the old one with the profiler on as without it
(the boundary peak breakdown tracks storages by weak reference)."""

from __future__ import annotations

import pytest

from .test_replaced_buffers import _first_step_frees_the_old_table

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("profiler_kwargs", [None, {}, {"by_layer": True}, {"overhead": None}], ids=["off", "default", "by_layer", "no_budget"])
def test_a_replaced_buffer_is_freed_on_the_gpu_with_the_profiler_as_without_it(profiler_kwargs):
    assert _first_step_frees_the_old_table(profiler_kwargs, device="cuda")
