"""Fetching a model from the Hugging Face Hub into a folder (``brook-engine fetch``): what a
pod's init container runs."""

from brook_engine.fetch.hub import Fetched, FetchError, fetch_hub

__all__ = ["FetchError", "Fetched", "fetch_hub"]
