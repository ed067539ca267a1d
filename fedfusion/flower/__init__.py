"""The Flower Message-API adapter: :class:`~fedfusion.flower.strategy.FusionStrategy` (the
core's fusion behind Flower's strategy hooks), node identity, sampling, streaming replies,
client errors, the train-config keys both sides import, and :class:`LocalGrid` (any
ClientApp in this process)."""
