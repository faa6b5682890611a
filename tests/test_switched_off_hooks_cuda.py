"""On the GPU, where backward and its boundaries run on autograd's device thread: a fault in the
forward, backward or optimizer-step hooks takes that part's hooks away by the faulted iteration's
end, the hooks still sleep through the same iterations as without the fault, the allocator's figures
are the same (nothing of the iteration is kept alive by the fault's log record), and so are the
weights (``tests/test_switched_off_hooks.py`` holds the checks)."""

from __future__ import annotations

import pytest

from .test_switched_off_hooks import FAULTS, check_switched_off

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_in_a_phase_hook_takes_its_hooks_away_on_the_gpu(fault, caplog):
    check_switched_off("cuda", fault, caplog)
