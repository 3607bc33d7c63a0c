"""Where a job runs past one machine, one module per engine: SLURM (slurm.py, sbatch.py),
Kubernetes (kubernetes.py: the job and its checks; trainjob.py: its YAML through Kubeflow's models), and the
one job description every engine reads (job.py: a config file's [launch] table under the
command's flags, and the checks made before anything is submitted)."""
