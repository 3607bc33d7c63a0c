"""Metrics, progress, the summary and plots: what a run shows and leaves behind (rank 0)."""
