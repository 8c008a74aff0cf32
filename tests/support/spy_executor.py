"""``SpyExecutor``: the engine's ``LocalExecutor`` with a record of every step, for scheduler and engine tests."""
from __future__ import annotations

import threading
from typing import Optional

from qwen_chat.engine.parallel.executors import LocalExecutor
from qwen_chat.engine.types import StepPlan

GATE_TIMEOUT_S = 30.0


class SpyExecutor(LocalExecutor):
    """A ``LocalExecutor`` (same ``runner`` and ``sampler`` arguments) that records and can steer its steps.

    Every plan launched is appended to ``plans`` and sets ``step_started`` (``execute`` launches too, so both
    scheduler modes, waiting and overlapped, pass there).  ``gate``: when given, each launch first waits for
    it to be set (an AssertionError after 30 s).  ``fail_on_step``: the launch of that plan (1-based) raises
    ``error`` (default ``RuntimeError("simulated device error")``) instead of running.  ``script``
    ({prompt length in tokens: [token ids]}): in ``execute`` (the waiting mode) the sampled ids of the request
    whose prompt has that length are replaced by these, one per step, until they run out.
    """

    def __init__(self, runner, sampler, gate: Optional[threading.Event] = None, fail_on_step: Optional[int] = None,
                 error: Optional[Exception] = None):
        super().__init__(runner, sampler)
        self.plans: list[StepPlan] = []
        self.gate = gate
        self.fail_on_step = fail_on_step
        self.error = error or RuntimeError("simulated device error")
        self.step_started = threading.Event()
        self.script: dict[int, list[int]] = {}
        self._scripted_slots: dict[int, list[int]] = {}

    def launch(self, plan: StepPlan):
        """Record ``plan``, wait for ``gate``, fail on step ``fail_on_step``, else ``LocalExecutor.launch``."""
        self.plans.append(plan)
        self.step_started.set()
        if self.gate is not None:
            assert self.gate.wait(GATE_TIMEOUT_S), "the test never opened the gate"
        if self.fail_on_step is not None and len(self.plans) == self.fail_on_step:
            raise self.error
        return super().launch(plan)

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """``LocalExecutor.execute``, then the ``script``ed token ids in place of the sampled ones."""
        out = super().execute(plan)
        for item in plan.prefills:
            if item.prompt.num_tokens in self.script:
                self._scripted_slots[item.slot] = list(self.script[item.prompt.num_tokens])
        for slot in plan.free_slots:
            self._scripted_slots.pop(slot, None)
        for slot, ids in self._scripted_slots.items():
            if slot in out and ids:
                out[slot] = ids.pop(0)
        return out
