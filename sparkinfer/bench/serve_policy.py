"""The engine steps a closed-loop serving level needs by the scheduler's policy alone.

    policy_steps(64, 512, 512, 128, slots=64, chunk=256, step_tokens=2048, announce=1024)

A `bench serve` level at concurrency C sends `requests` prompts of `input_len` tokens,
each for `output_len` tokens, C at a time: a stream sends its next request when the last
one ends. Here that runs through a `Scheduler` with the server's capacities, a model that
answers at once (each decode row one token, each prompt's last chunk its first) and
clients that answer in `turnaround_steps` steps (0: before the next step's admission).
The count is what the policy itself costs (admission, chunk budget, announced chunks,
the drain of the last requests): a served level's engine steps beyond it were spent
outside the scheduler (the HTTP path, the clients, the engine's host loop). Pure CPU.
"""

from __future__ import annotations

__all__ = ["policy_steps"]


def policy_steps(concurrency: int, requests: int, input_len: int, output_len: int, *, slots: int, chunk: int,
                 step_tokens: int, announce: int = 0, prefill_wait_steps: int = 0,
                 turnaround_steps: int = 0) -> int:
    """Engine steps that ran a plan until every request of the level has its `output_len`
    tokens (ticks with nothing to run, waiting on the clients, are not counted)."""
    from sparkinfer.engine.plan import RowResult, StepResult, TokenRows
    from sparkinfer.engine.request import SamplingParams
    from sparkinfer.engine.scheduler import SchedRequest, Scheduler, SchedulerCaps

    # the level's prompts are random ids, which share no prefix: these stand-ins must not either
    caps = SchedulerCaps(slots=slots, max_context=input_len + output_len, chunk=chunk, step_tokens=step_tokens,
                         max_waiting=requests, prefill_wait_steps=prefill_wait_steps, announce=announce,
                         reuse_prefix=False)
    sched, params = Scheduler(caps), SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    sent = 0

    def send():
        nonlocal sent
        sched.add(SchedRequest(sent, [1] * input_len, params, frozenset()))
        sent += 1

    for _ in range(min(concurrency, requests)):
        send()
    due: list[int] = []  # the clock ticks at which ended requests' streams send again
    clock = run = 0  # a tick is an engine step's time; run counts the steps that ran a plan
    while True:
        for _ in range(sum(d <= clock for d in due)):
            if sent < requests:
                send()
        due = [d for d in due if d > clock]
        plan = sched.schedule()
        if plan is None and not due:
            return run
        if plan is not None:
            prefill = tuple(RowResult((c.start + len(c.tokens),) if c.last else ()) for c in plan.prefill)
            ended = sum(u.finish is not None for u in sched.update(
                plan, StepResult(plan.step, TokenRows(plan.decode.position + 1), prefill)))
            due += [clock + 1 + turnaround_steps] * ended
            run += 1
        clock += 1
