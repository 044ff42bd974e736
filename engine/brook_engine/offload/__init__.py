"""Weight offload: the memory plan (``plan``, torch-free), the ledger that holds device
weight bytes to the budget, the tiers streamed weights live in (host pool, spill file), and
the streamer that fills a ring of device slots ahead of compute."""
