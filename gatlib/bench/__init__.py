"""gatlib's benchmark harness, behind the ``gatlib`` command (:mod:`.cli`): datasets, training
(:mod:`.train`), the comparison with PyG (:mod:`.compare`), the Triton kernels' self-test
(:mod:`.selftest`). It imports the library; the library never imports it.
"""
