"""Compiled shapes (``shapes.mode: compile``): token-count buckets, a compiled graph of the
decoder layer per bucket, the bounded kernel cache, online learning and the persistent cache."""
