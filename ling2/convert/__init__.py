"""ling2.convert."""
