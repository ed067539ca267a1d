"""fedfusion: Flower strategies that fuse client models in one shot (or a few rounds)."""

__version__ = "0.1.0"
