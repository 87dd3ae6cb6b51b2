"""gatlib's benchmark harness: datasets (:mod:`.data`, :mod:`.synthetic`),
training recipes and loop (:mod:`.train`), the comparison with PyTorch
Geometric (:mod:`.compare`, measured with :mod:`.measure`; on CUDA set
against the bandwidth floor of :mod:`.floor`), the Triton
kernels' check on a device (:mod:`.selftest`), the ``gatlib`` command
(:mod:`.cli`) and what every result file carries (:mod:`.report`).

The harness imports the library; the library never imports the harness.
"""
