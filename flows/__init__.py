"""Prefect flows that chain the pipeline's stage tasks, and the command-line interface."""
