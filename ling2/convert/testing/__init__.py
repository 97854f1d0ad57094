"""Test helpers for ling2.convert."""
