"""The engine loop: requests in, scheduled batches through the model runner, tokens out; and
the start-up of a replica's ranks."""
