"""Brook's Kubernetes operator and the ``brook`` command line."""

__version__ = "0.1.0"
