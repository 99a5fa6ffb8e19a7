"""Wrappers that attach the metrics pipeline to an engine without changing its decisions."""
