"""gatlib's developer instruments, run from a checkout (``python -m tools.X`` in
the repository root) and not installed with gatlib (the wheel holds the library
and the ``gatlib`` command's harness: docs/packaging.md). ``benchmarks/`` keeps
the scripts that reproduce a documented table; what is here measures, profiles
or checks the kernels while they are developed:

* without a GPU: the compile budget of the Triton kernels at the users' shapes
  (:mod:`.triton_compile`), what a first step compiles and tunes (:mod:`.tuning_cost`) and
  the launch counter of a layer call and a training step (:mod:`.launches`), against a
  stand-in GPU driver, held to a budget by the tests; torch.profiler's table of a fused-CPU
  layer (:mod:`.profile_fused_cpu`); what a lost gradient term does to the GAT
  step's checked gradient (:mod:`.cut_terms`); every layer's outputs saved from
  one checkout and compared bit for bit with another's (:mod:`.outputs_ab`);
* on a GPU: the GPU run (:mod:`.gpu_run`, its dry run on CPU), a training step kernel by
  kernel (:mod:`.profile_step`), the Triton kernels against the reference, the two-pass form
  and ``torch.sparse.mm`` with each pass's bandwidth floor (:mod:`.triton_bench`), and what the
  autotuner measured (:mod:`.autotune_report`).

Like the harness they see the library through its public names and
:mod:`gatlib.introspect`, and :mod:`.internals`, the one module here that reads gatlib's
private modules; nothing in the package or in ``benchmarks/`` imports them.
"""
