"""Benchmarks: `python -m benchmarks` runs them all and prints one table.

Speed targets are ratios measured in the same run; nothing here asserts times.
"""
