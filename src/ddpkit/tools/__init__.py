"""Commands that inspect rather than train: ddpkit env (doctor.py) and ddpkit bench (bench.py)."""
