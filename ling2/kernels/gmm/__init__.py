"""Grouped matmul over rows sorted by group (the dropless MoE's expert products)."""
