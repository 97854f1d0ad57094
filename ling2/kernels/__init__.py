"""ling2.kernels."""
