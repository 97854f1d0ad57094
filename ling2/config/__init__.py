"""ling2.config."""
