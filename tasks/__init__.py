"""Prefect tasks: one pipeline stage each (entity resolution, preferences, reward fit, training, export)."""
