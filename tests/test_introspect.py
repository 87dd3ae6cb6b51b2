"""gatlib.introspect, the harness's view of the kernels, and tools.internals, what only tools
and tests read: each name is the kernels' own object (or calls it), and importing either
needs no Triton."""
import importlib.util
import subprocess
import sys

import pytest
import torch

import gatlib
from gatlib import _dispatch, introspect
from tools import internals

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed: the Triton names cannot resolve")


def test_not_a_user_api():
    assert "introspect" not in gatlib.__all__ and "not a user API" in introspect.__doc__
    assert set(introspect.__all__) <= set(dir(introspect))
    assert set(internals.__all__) <= set(dir(internals)) | set(internals._TRITON_CONSTANTS)


def test_dispatcher_kernels_are_the_dispatchers(monkeypatch):
    for name in ("torch", "scatter", "fused", "triton"):
        assert introspect.kernel(name) is _dispatch.KERNELS[name]
    stand_in = _dispatch.ReferenceKernel()  # looked up when called: a test's patch shows
    monkeypatch.setitem(_dispatch.KERNELS, "triton", stand_in)
    assert introspect.kernel("triton") is stand_in


@pytest.mark.slow
def test_importing_it_needs_no_triton():
    code = ("import sys; sys.modules['triton'] = None; import torch, gatlib.introspect as i; "
            "print(i.kernel('triton').available(torch.device('cpu')), 'gatlib._triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False" and "not installed" in out.stdout, out.stdout


@needs_triton
def test_triton_names_are_the_kernels_own():
    from gatlib import _triton, _triton_kernels, _triton_schedule

    assert internals.TRITON_SPLIT == _triton_schedule._SPLIT
    assert internals.TRITON_MAX_TILE == _triton._MAX_TILE
    kernels = introspect.triton_kernels()
    assert {"_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel", "_alpha_kernel", "_keep_kernel",
            "_merge_kernel"} == set(kernels)
    for name, fn in kernels.items():
        assert fn is getattr(_triton_kernels, name) and fn.__name__ == name
    assert not hasattr(internals, "NO_SUCH_NAME")  # (__getattr__ raises AttributeError)


@needs_triton
def test_triton_functions_call_the_kernels_own(monkeypatch):
    from gatlib import _triton, _triton_schedule

    plan = gatlib.GraphPlan(torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]]), num_nodes=3)
    assert introspect.triton_schedule(plan) is _triton_schedule._plan(plan)  # built once, kept on the plan
    seed = internals.draw_dropout_seed(torch.device("cpu"))
    assert seed.shape == (1,) and seed.dtype == torch.int64
    calls = []
    # the mask: the kernel's, over the schedule's edge order kept on the plan
    monkeypatch.setattr(_triton, "_keep_mask", lambda *a: calls.append(a) or "_keep_mask")
    assert internals.dropout_keep_mask(plan, 2, 0.5, seed) == "_keep_mask"
    assert calls[-1][0] is _triton_schedule._plan(plan).csr_eid and calls[-1][1:] == (2, 0.5, seed)
    for private, public, args in (
            ("_check_interpreter", "check_triton_interpreter", ()),
            ("_draw_seed", "draw_dropout_seed", ("cpu",)),
            ("attention", "triton_attention", (None, None, plan, None, 0.0, False))):
        monkeypatch.setattr(_triton, private, lambda *a, _n=private: calls.append((_n, a)) or _n)
        result = getattr(introspect if public == "check_triton_interpreter" else internals, public)(*args)
        assert calls[-1] == (private, args)
        assert result == (None if public == "check_triton_interpreter" else private)


@needs_triton
def test_cpu_tensors_admitted_only_inside(monkeypatch):
    from gatlib import _triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton, cpu = introspect.kernel("triton"), torch.device("cpu")
    assert triton.available(cpu) is not None
    real = _triton._check_interpreter
    with internals.triton_admits_cpu_tensors():
        assert triton.available(cpu) is None
        introspect.check_triton_interpreter()  # lifted: no error
    assert triton.available(cpu) is not None and _triton._check_interpreter is real





