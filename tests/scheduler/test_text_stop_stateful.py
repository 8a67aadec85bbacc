"""`Scheduler.stop_sample` (a stop string found in a sample's text) at any
point between steps: the scheduler state machine of
`tests/scheduler/test_scheduler_stateful.py` (shadow storage, integrity and
scheduler/manager agreement after every rule, no leak at teardown) with one
more rule that stops a random sample of a random live request, whether it
runs, waits after preemption, is swapped out, or is a prompt not forked yet."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from scheduler import RequestStatus
from tests.scheduler.test_scheduler_stateful import SchedulerMachine


class StopSampleMachine(SchedulerMachine):
    @precondition(lambda self: hasattr(self, "s") and self.next_id > 0)
    @rule(which=st.integers(0, 1000), index=st.integers(0, 2))
    def stop_sample(self, which, index):
        rid = which % self.next_id
        request = self.s.get_request(rid)
        out = self.s.stop_sample(rid, index % request.sampling.n if request else 0)
        if request is None:
            assert out is None  # finished or aborted: nothing to stop
            return
        index %= request.sampling.n
        forked = request.sampling.n == 1 or any(request.outputs)
        if out is None:
            # a sample already ended, or an n > 1 prompt not forked yet
            assert request.finish_reasons[index] is not None or not forked
            return
        assert request.finish_reasons[index] is RequestStatus.FINISHED_STOPPED
        assert out.finish_reasons == request.finish_reasons
        if all(r is not None for r in request.finish_reasons):
            assert out.finished and self.s.get_request(rid) is None
        else:
            assert not out.finished and self.s.get_request(rid) is request
        assert self.s.stop_sample(rid, index) is None  # a second stop is a no-op


StopSampleMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStopSampleMachine = StopSampleMachine.TestCase
