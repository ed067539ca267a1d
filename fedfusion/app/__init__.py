"""The fedfusion Flower App: run config, data split, launcher, replay CLI, in-process grid.

Everything here is a user of the library (``fedfusion.strategies``, ``fedfusion.client``,
``fedfusion.wire``, ...); nothing in the library imports this package. The App's Flower
components are :mod:`fedfusion.server_app` and :mod:`fedfusion.client_app`.
"""
