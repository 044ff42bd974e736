"""Fetching a model from the Hugging Face Hub into a folder (``brook-engine fetch``): what a
pod's init container runs, with its progress served for the operator's status."""

from brook_engine.fetch.hub import Fetched, FetchError, fetch_hub, file_patterns
from brook_engine.fetch.progress import Progress, ProgressServer, hub_lister

__all__ = [
    "FetchError",
    "Fetched",
    "Progress",
    "ProgressServer",
    "fetch_hub",
    "file_patterns",
    "hub_lister",
]
