"""Brook's inference engine. The configuration (``brook_engine.config``) is torch-free; the
rest of the engine imports torch."""

__version__ = "0.1.0"
