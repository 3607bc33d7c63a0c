"""Will it fit: the memory plan (memory.py): what each rank holds under each strategy, its peak
(peak.py), and `--strategy auto`'s choice; what a process measures of itself for the plan and a
run's report (process.py). The run's request for it (the task built as the workers build it) is
run/plan.py."""
