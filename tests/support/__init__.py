"""What the tests share: the one place for helpers used by tests of more than one package.

- ``tp_testing``: seeded inputs, shard assembly, the fp32 tolerances of the tensor-parallel tests.
- ``dense_reference``: single-process dense modules the parallel layers are compared against.
- ``attention_cases``: attention inputs and mask cases shared by the kernel and layer tests.
- ``moe_reference``: a dense mixture-of-experts reference.
- ``device_audit``: finds device mistakes (tensors made on the default device) on a CPU machine.
- ``pretrain_run``: starts ``pretrain`` with ``tpfuse.pretrain_gpt``'s callbacks in the test's
  process (a rank body of ``run_distributed``), and rank bodies that return its losses or error.

The test folders mirror the packages (``tests/parallel`` tests ``tpfuse.parallel``, and so on);
tests that cross every package (invariance, layering, docs, device placement) sit at the top.
"""
