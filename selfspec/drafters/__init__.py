"""Drafters that need no trained weights: a separate draft model and prompt lookup."""
