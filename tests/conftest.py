"""Test-session set-up shared by every test module."""
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter (numpy
# emulation). The variable must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests: random examples on a developer's machine, the same ones on
# every CI run (a failure there is reproducible; shrinking works either way).
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def one_thread():
    """One torch thread for the test: small graphs gain nothing from a second one,
    and on a busy 2-core machine OpenMP threads slow every op down several times.
    Modules that train or benchmark end to end use it for all their tests
    (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def auto_fused(monkeypatch):
    """``backend="auto"`` takes the fused CPU kernel whatever the graph's size, so
    that a test of the default path on a small graph tests the fused kernel (on
    such a graph auto's size rule picks the reference; the rule itself is tested
    in test_core.py::test_auto_rule)."""
    import gatlib._dispatch

    monkeypatch.setattr(gatlib._dispatch, "FUSED_CPU_MIN_ENTRIES", 0)
