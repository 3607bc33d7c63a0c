"""How many processes, where: the launch plan (plan.py), torch's elastic agent on this node
(elastic.py), and SLURM batch scripts (sbatch.py)."""
