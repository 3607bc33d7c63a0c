"""Will it fit: the memory plan (memory.py): what each rank holds under each strategy, its peak, and
`--strategy auto`'s choice. The run's request for it (the task built as the workers build it) is
run/plan.py."""
