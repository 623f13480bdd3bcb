"""`octavo bench`: the benchmark that ships with the product, the load-test client of
`octavo bench serve` (load_test.py). The repository's other benchmarks live in its
benchmarks/ folder, run from a checkout, and are not installed."""
