"""The simulator's one exception type."""

from __future__ import annotations


class SimulationError(ValueError):
    """A trace, profile or policy the simulator cannot run. The message names the file, the
    line or field, the value and the fix."""
