"""ling2.infer."""
