"""ling2.layers."""
