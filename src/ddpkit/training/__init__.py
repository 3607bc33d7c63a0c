"""The loop (loop.py), one optimizer step (step.py), evaluation, resume, signals."""
