"""Studies: scripts that answered one question about a design choice (where a TPU save's time
goes, what pausing the garbage collector buys). Kept runnable, not tracked as benchmarks; see
``benchmarks/README.md``.
"""
