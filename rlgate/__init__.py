"""rlgate: reinforcement learning as an API for existing OpenAI-compatible agents."""

__version__ = "0.1.0"
