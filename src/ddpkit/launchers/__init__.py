"""How many processes, where: the launch plan (plan.py), torch's elastic agent on this node
(elastic.py), and what a launched run reports (report.py). SLURM, Ray, Kubernetes and SkyPilot
jobs are engines/'s."""
