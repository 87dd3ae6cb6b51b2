"""gatlib's developer instruments: the compile table of every Triton
specialisation (:mod:`.triton_compile`) and the launch counter of a layer call
and a training step (:mod:`.launches`), both run on CPU against a stand-in GPU
driver. They are run from a checkout (``python -m tools.triton_compile``,
``python -m tools.launches`` in the repository root) and by the tests that hold
their numbers to a budget; they are not installed with gatlib (the wheel holds
the library and the ``gatlib`` command's harness: docs/packaging.md). Like the
harness they see the library through its public names and
:mod:`gatlib.introspect`, and write results with :mod:`gatlib.bench.report`;
nothing in the package imports them.
"""
