"""Test-only helpers for ling2.kernels (may import test packages)."""
