"""Benchmarks (``python -m benchmarks``) and the functionalization fuzzer; the models they
run on live in tests/models (shared with the tests, which never import benchmarks)."""
