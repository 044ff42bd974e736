"""The autoscaler: a pure policy (``policy``), the metrics it reads (``scrape``), the loop
that applies it in the operator (``loop``), and a simulator that replays request traces
against it and against baselines (``simulate``)."""
