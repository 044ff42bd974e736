"""The CRD: generated from the API models, and the offline validation of manifests against
it (schema, defaults and CEL rules, as the API server applies them)."""
