"""``brook monitor``: live figures of ``LLMInference`` resources — a ``kubectl get``-like
table, or a full-screen dashboard — from the resource's status and its engines' ``/metrics``
(through the API server's pod proxy, a Prometheus server, or the servers ``brook up``
started on this machine)."""
