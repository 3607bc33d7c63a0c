"""A run's lifecycle: `train()` in the launcher (the checks before any worker starts, the run
folder, the workers started by torch's agent), what every worker does (worker.py), and the
notebook's forked workers."""
