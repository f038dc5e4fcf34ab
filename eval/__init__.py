"""Evaluation: the CLI, corpora, sweeps, reports and plots."""
