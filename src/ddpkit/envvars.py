"""The environment variables ddpkit itself reads or sets, by name. The launcher side (cli, api,
launchers) and the worker side (worker, reporting) both import them, so they sit at the bottom
layer, beside errors.py, and import nothing."""

# the launcher -> its workers
ERROR_DIR_VAR = "DDPKIT_ERROR_DIR"  # where a worker writes a user error for the launcher to print
LAUNCH_TIME_VAR = "DDPKIT_LAUNCH_TIME"  # when the command started (the summary's wall time)

# a user or a benchmark -> ddpkit
BENCH_RESULT_VAR = "DDPKIT_BENCH_RESULT"  # set: rank 0 prints the summary as one `RESULT {json}` line
SLOW_EXIT_VAR = "DDPKIT_SLOW_EXIT"  # set: the CLI leaves through the interpreter's teardown, not os._exit
PROGRESS_INTERVAL_VAR = "DDPKIT_PROGRESS_INTERVAL"  # seconds between in-epoch progress lines (default 30)
