"""Who goes first: --scheduling-policy fcfs (default) or priority (vLLM's `priority`, lower value first).

A policy turns a waiting sequence's fairness tag (core/waiting_queue.py: about its arrival step) into the key the
waiting queue orders by (smaller first), and decides which running sequences a waiting one may preempt.

fcfs: key = tag. Nothing is preempted for a waiting request; a sequence preempted for memory waits again with
its old key, so it comes back before what arrived after it.

priority: key = priority * aging_steps + tag. A sequence that has waited aging_steps steps ranks as one level
more urgent than one of the same priority arriving now, so a steady stream of urgent requests delays a
low-priority one by at most (its priority - theirs) * aging_steps steps of arrivals, never forever. Only time
spent waiting ages a sequence: one that is preempted waits again with its key moved back by the steps it ran,
so a long low-priority job stays preemptible.

Preemption by priority: a waiting sequence W takes the place of a running R (when the batch or the pool is
full) only if W's priority is strictly lower than R's and W's key is smaller than the key R would wait with.
The second condition keeps the queue consistent with the preemption (W is admitted before R comes back), and
the first one means R can never preempt W back: each preemption lowers the priority running.

Turns: a sequence paused for a more urgent one (it keeps its blocks, core/scheduler.py) falls behind the others
of its priority by every step it waits. Left alone it finishes that many steps after them, and a batch job's
last answer with it: 8 urgent requests of 16 tokens during 32 x 256-token low-priority ones added a tail of 30
steps at 3-5 rows (+9% time for 3.8% more tokens). So a paused sequence at the head of the queue takes the
turn of a running one of the same priority that has run TURN_STEPS steps more (its key, moved back by the
steps it ran, is that much smaller): the delay is shared out, at most about TURN_STEPS steps each.
"""
from __future__ import annotations

from pagedserve.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")
TURN_STEPS = 4


class FCFSPolicy:
    name = "fcfs"
    preempts_for_waiting = False

    def queue_key(self, req: Request, tag: int) -> int:
        return tag

    def requeue_key(self, req: Request, now: int) -> tuple[int, int]:
        return req.queue_key

    def outranks(self, waiting: Request, running: Request, now: int) -> bool:
        return False

    def takes_turn(self, paused: Request, running: Request, now: int) -> bool:
        return False

    def holds_back(self, lead: Request | None, req: Request) -> bool:
        return False

    def order_running(self, running: list[Request]) -> None:
        # Admission order: the newest is preempted first when the pool runs short.
        pass


class PriorityPolicy:
    name = "priority"
    preempts_for_waiting = True

    def __init__(self, aging_steps: int) -> None:
        self.aging_steps = aging_steps

    def queue_key(self, req: Request, tag: int) -> int:
        return req.priority * self.aging_steps + tag

    def requeue_key(self, req: Request, now: int) -> tuple[int, int]:
        key, arrival = req.queue_key
        return key + now - req.admitted_step, arrival

    def outranks(self, waiting: Request, running: Request, now: int) -> bool:
        return (waiting.priority < running.priority
                and waiting.queue_key < self.requeue_key(running, now))

    def takes_turn(self, paused: Request, running: Request, now: int) -> bool:
        key, arrival = self.requeue_key(running, now)
        return paused.priority == running.priority and paused.queue_key < (key - TURN_STEPS, arrival)

    def holds_back(self, lead: Request | None, req: Request) -> bool:
        # lead's prompt is computed this step: req's, less urgent, waits for the next.
        return lead is not None and lead.priority < req.priority

    def order_running(self, running: list[Request]) -> None:
        # Most urgent first (the key it would wait with): they get the token budget first, and the last is
        # the one preempted first. The order holds from step to step: all running keys move together.
        running.sort(key=lambda r: (r.queue_key[0] - r.admitted_step, r.queue_key[1]))


def make_policy(name: str, aging_steps: int) -> FCFSPolicy | PriorityPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(aging_steps)
    raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")
