"""ling2.data."""
