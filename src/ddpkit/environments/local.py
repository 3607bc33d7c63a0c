"""No launcher placed this process: `ddpkit train` starts this node's workers itself (torch's
elastic agent), and a script's ddpkit.init() is one process alone. Always detected, so it is
the last entry of the registry."""

from __future__ import annotations

from typing import Any, Mapping

from .base import Environ, Environment


class Local(Environment):
    name = "single"
    starter = "ddpkit"
    outside_launcher = False

    def detect(self, e: Environ) -> bool:
        return True

    def fields(self, e: Environ) -> dict[str, Any]:
        return {}  # DistEnv's defaults: rank 0 of 1, master on loopback

    def title(self, report: Mapping[str, Any]) -> str:
        return "none (ddpkit starts the workers itself)"
