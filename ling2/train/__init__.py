"""ling2.train."""
