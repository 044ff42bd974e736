"""Decoder models and their loading from Hugging Face folders."""
