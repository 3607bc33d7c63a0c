"""Built-in tasks. Each module has a build(config) returning a ddpkit.Task."""
