"""Per-request switch-off of speculation on low acceptance (SpeculativeConfig.disable_by_acceptance_rate).

Every verified draft token costs a query row of the target's forward pass; a request whose drafts are rarely
accepted (free-form text under n-gram lookup, a draft model that disagrees with the target on this request's
kind of text) pays for rows that emit nothing. Each request's recent draft tokens are counted over a sliding
window of at least acceptance_window of them:

    step:      1    2    3    4 ...          rate = accepted / drafted over the last steps that hold
    drafted:   3    3    0    3              >= acceptance_window draft tokens (steps with none are skipped)
    accepted:  0    1    -    0

Once a full window's rate is below disable_by_acceptance_rate the request gets no drafts for the rest of its
life (its output distribution is the target's either way). Torch-free: it reads counts only.
"""
from __future__ import annotations

from collections import deque

from pagedserve.config import SpeculativeConfig


class AcceptanceTracker:
    def __init__(self, min_rate: float, window: int) -> None:
        self.min_rate = min_rate
        self.window = window
        # Per request still drafting: (drafted, accepted) of each recent step with drafts, and their sums.
        self._steps: dict[str, deque[tuple[int, int]]] = {}
        self._sums: dict[str, list[int]] = {}
        # Requests switched off; every proposer skips them (spec_decode/proposer.py, SampledStep.undrafted).
        self.disabled: set[str] = set()

    @classmethod
    def from_config(cls, config: SpeculativeConfig | None) -> AcceptanceTracker | None:
        if config is None or config.disable_by_acceptance_rate is None:
            return None
        return cls(config.disable_by_acceptance_rate, config.acceptance_window)

    def record(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0 or req_id in self.disabled:
            return
        steps = self._steps.setdefault(req_id, deque())
        sums = self._sums.setdefault(req_id, [0, 0])
        steps.append((num_drafted, num_accepted))
        sums[0] += num_drafted
        sums[1] += num_accepted
        # Drop the oldest steps while the rest still fill the window.
        while sums[0] - steps[0][0] >= self.window:
            drafted, accepted = steps.popleft()
            sums[0] -= drafted
            sums[1] -= accepted
        if sums[0] >= self.window and sums[1] < self.min_rate * sums[0]:
            self.disabled.add(req_id)
            del self._steps[req_id], self._sums[req_id]

    def rate(self, req_id: str) -> float | None:
        sums = self._sums.get(req_id)
        return None if sums is None or sums[0] == 0 else sums[1] / sums[0]

    def forget(self, req_id: str) -> None:
        self._steps.pop(req_id, None)
        self._sums.pop(req_id, None)
        self.disabled.discard(req_id)
