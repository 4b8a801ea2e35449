"""Benchmarks: our trainers side by side with the public reference library, and the pipeline's overhead."""
