"""How many processes, where: the launch plan (plan.py), torch's elastic agent on this node
(elastic.py), SLURM batch scripts (sbatch.py) and what goes into a SLURM job (slurm_job.py)."""
