"""Engine metrics: names (``names``, torch- and Prometheus-free, read by the operator's
autoscaler), plain stats the engine produces (``stats``), and their Prometheus form
(``prometheus``)."""
