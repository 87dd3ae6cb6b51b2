"""Test-session set-up shared by every test module."""
import os
import random
import sys
from pathlib import Path

import pytest
import torch

# The developer instruments (tools/) are run from a checkout, not installed: tests
# import them from the repository root, wherever pytest was started.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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


def pytest_configure(config):
    # xdist's workers share the machine's cores: each with torch's default (a thread per core)
    # oversubscribes them, and OpenMP threads then wait on each other. A test that needs more
    # threads than its share sets them (e.g. test_fused_cpu's "tiny_blocks").
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_addoption(parser):
    parser.addoption(
        "--test-order", default="default", metavar="ORDER",
        help="default, reverse, or random:SEED: the order of the test files and of the tests "
             "in each file, to show that no test depends on what another left behind")


def pytest_collection_modifyitems(config, items):
    order = config.getoption("--test-order")
    if order == "default":
        return
    files = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    groups = list(files.values())
    if order == "reverse":
        groups = [group[::-1] for group in groups[::-1]]
    elif order.startswith("random:") and order[7:].isdigit():
        rng = random.Random(int(order[7:]))
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
    else:
        raise pytest.UsageError(f"--test-order takes default, reverse or random:SEED, not {order!r}")
    items[:] = [item for group in groups for item in group]


def pytest_report_header(config):
    return f"test order: {config.getoption('--test-order')}"


# Environment variables that pytest, torch (inductor's first compile) and ogb's imports
# (`outdated`, and the OpenMP settings of its dependencies) set themselves.
OWN_ENV = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "OUTDATED_IGNORE", "KMP_")
# The packages whose module constants a test must leave as it found them: the
# library and harness, and the developer instruments the tests import.
OWN_PACKAGES = ("gatlib", "tools")


def _global_state():
    """What a test could change for the tests after it: torch's switches, the
    environment, and every plain value (number, string, tuple, None) at the top of
    a gatlib or tools module (its tunable constants)."""
    from torch.utils import deterministic

    state = {"torch threads": torch.get_num_threads(),
             "torch default dtype": torch.get_default_dtype(),
             "torch grad mode": torch.is_grad_enabled(),
             "torch deterministic": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled(),
                                     deterministic.fill_uninitialized_memory),
             "os.environ": {k: v for k, v in os.environ.items() if not k.startswith(OWN_ENV)}}
    for name, module in list(sys.modules.items()):
        if name in OWN_PACKAGES or name.startswith(tuple(p + "." for p in OWN_PACKAGES)):
            for attr, value in vars(module).items():
                if isinstance(value, (bool, int, float, str, tuple, type(None))) \
                        and not attr.startswith("__"):
                    state[f"{name}.{attr}"] = value
    return state


def _restore(before):
    from torch.utils import deterministic

    torch.set_num_threads(before["torch threads"])
    torch.set_default_dtype(before["torch default dtype"])
    torch.set_grad_enabled(before["torch grad mode"])
    on, warn_only, fill = before["torch deterministic"]
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    deterministic.fill_uninitialized_memory = fill
    for key in set(os.environ) - set(before["os.environ"]):
        if not key.startswith(OWN_ENV):
            del os.environ[key]
    os.environ.update(before["os.environ"])
    for key, value in before.items():
        module, _, attr = key.rpartition(".")
        if module in sys.modules and key.startswith(OWN_PACKAGES):
            setattr(sys.modules[module], attr, value)


@pytest.fixture(autouse=True)
def no_state_left_behind():
    """Every test starts from the same random state (``torch.manual_seed(0)``, as
    in a fresh process) and leaves the global state as it found it: what it
    changed without a restoring fixture (``monkeypatch``, ``one_thread``) is put
    back and the test errors, naming it. A ``torch.compile`` in a test is reset
    after it, so no compiled code or recompile count carries over."""
    rng = torch.random.get_rng_state()
    torch.manual_seed(0)
    dynamo = sys.modules.get("torch._dynamo")
    frames = sum(dynamo.utils.counters["frames"].values()) if dynamo else 0
    before = _global_state()
    yield
    torch.random.set_rng_state(rng)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and sum(dynamo.utils.counters["frames"].values()) != frames:
        dynamo.reset()
    after = _global_state()
    changed = sorted(k for k in before if k in after and after[k] != before[k]
                     and not (isinstance(before[k], float) and before[k] != before[k]))
    if changed:
        _restore(before)
        pytest.fail(f"the test left global state changed (restored now): {', '.join(changed)}",
                    pytrace=False)


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
