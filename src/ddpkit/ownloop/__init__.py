"""For users who keep their own loop: `ddpkit.init()` and the Session it returns (the same
strategy, loader and checkpoints `ddpkit train` uses)."""
