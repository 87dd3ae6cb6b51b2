"""gatlib's developer instruments, run from a checkout (``python -m tools.X`` in
the repository root) and not installed with gatlib (the wheel holds the library
and the ``gatlib`` command's harness: docs/packaging.md). ``benchmarks/`` keeps
the scripts that reproduce a documented table; what is here measures, profiles
or checks the kernels while they are developed:

* without a GPU: the compile table of every Triton specialisation
  (:mod:`.triton_compile`) and the launch counter of a layer call and a training
  step (:mod:`.launches`), both against a stand-in GPU driver, held to a budget
  by the tests; torch.profiler's table of a fused-CPU
  layer (:mod:`.profile_fused_cpu`); what a lost gradient term does to the GAT
  step's checked gradient (:mod:`.cut_terms`); every layer's outputs saved from
  one checkout and compared bit for bit with another's (:mod:`.outputs_ab`);
* on a GPU: a training step kernel by kernel (:mod:`.profile_step`), and the Triton kernels
  against the reference with each pass's bandwidth floor (:mod:`.triton_bench`).

Like the harness they see the library through its public names and
:mod:`gatlib.introspect`, and :mod:`.internals`, the one module here that reads gatlib's
private modules; nothing in the package or in ``benchmarks/`` imports them.
"""
