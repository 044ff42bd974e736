"""The building blocks of a decoder: norm, rotary embedding, paged attention, MLP, sampler."""
