"""Grafana dashboards for kvmetrics, built in Python; ``python -m dashboards.build`` writes them."""
