"""How a run is parallelised, described without torch: the strategies' registry and rules
(spec.py) and what each holds per rank (footprints.py). The torch side is strategies/."""
