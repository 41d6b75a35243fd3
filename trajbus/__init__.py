"""trajbus: the trajectory data bus for agentic-RL sandbox fleets."""
__version__ = "0.1.0"
