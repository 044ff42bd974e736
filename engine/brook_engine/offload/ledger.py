"""The ledger of device bytes held by weights: every allocation is charged before it is made,
and a charge that would pass the budget (``offload.deviceMemoryLimitGb``) is refused."""

from __future__ import annotations

from brook_engine.offload.plan import PlanError, size_text


class WeightLedger:
    """Device bytes held by weights, by what holds them (fixed, resident, slots)."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.held = 0
        self.peak = 0
        self.by_kind: dict[str, int] = {}

    def charge(self, nbytes: int, kind: str, what: str) -> None:
        """Count ``nbytes`` more (before they are allocated); ``PlanError`` past the budget."""
        if self.budget is not None and self.held + nbytes > self.budget:
            raise PlanError(
                f"offload.deviceMemoryLimitGb: {what} needs {size_text(nbytes)} more, and "
                f"weights already hold {size_text(self.held)} of the {size_text(self.budget)} "
                "budget; raise the budget (brook-engine plan shows what each rank needs)"
            )
        self.held += nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int, kind: str) -> None:
        self.held -= nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0) - nbytes
