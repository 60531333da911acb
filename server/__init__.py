"""tokenwire server: gateway, worker, engine and store."""

__version__ = "0.1.0"
