"""Benchmark harness for orbax-safetensors.

Run ``python benchmarks/run.py --help``; see ``benchmarks/README.md`` for the protocol.
"""
