"""The bad-input suite: cases as data (one module per category), the classifier (:mod:`.harness`) and the
shared fixtures. ``tests/test_bad_inputs.py`` asserts every case is refused clearly; ``tools/bad_inputs.py``
prints the table. See docs/bad_inputs.md."""
