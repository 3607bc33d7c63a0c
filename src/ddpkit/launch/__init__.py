"""Launchers: how many processes, where. Each starts workers; none trains."""
