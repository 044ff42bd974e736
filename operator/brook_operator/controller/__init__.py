"""Reconciliation: children from the spec, status from the children."""

from brook_operator.controller.reconcile import Reconciler, ReconcileResult
from brook_operator.controller.status import compute_status, spec_error

__all__ = ["ReconcileResult", "Reconciler", "compute_status", "spec_error"]
