"""The agentic pipeline (issue 5): an agent's output enters training the moment it is scored, and the
next agent starts on it at once. :mod:`.scheduler` decides; the Ray driver and the simulator execute."""
