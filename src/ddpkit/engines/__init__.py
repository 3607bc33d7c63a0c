"""Where a job runs past one machine, one module per engine: SLURM (slurm.py, sbatch.py), and the
one job description every engine reads (job.py: a config file's [launch] table under the
command's flags, and the checks made before anything is submitted)."""
