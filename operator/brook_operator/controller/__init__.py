"""Reconciliation: children from the spec, status from the children."""

from brook_operator.controller.conditions import compute_status, spec_error
from brook_operator.controller.reconcile import Reconciler, ReconcileResult

__all__ = ["ReconcileResult", "Reconciler", "compute_status", "spec_error"]
