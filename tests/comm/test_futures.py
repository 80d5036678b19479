"""``_futures.all_of``: one future for several collectives, errors kept, CUDA streams joined."""

from __future__ import annotations

import pytest
import torch

from aiak.comm import _futures


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut = _futures.new_future(value)
    fut.set_result(value)
    return fut


def _failed(message: str) -> torch.futures.Future:
    trigger = torch.futures.Future()

    def fail(_):
        raise _futures.CommError(message)

    out = trigger.then(fail)
    trigger.set_result(None)
    return out


def test_all_of_gives_like_once_every_input_is_done() -> None:
    like = torch.zeros(3)
    pending = torch.futures.Future()
    seen: list[torch.Tensor] = []
    fut = _futures.real(
        _futures.after(_futures.all_of([_done(torch.ones(2)), pending], like), seen.append, like)
    )
    assert not fut.done() and not seen
    pending.set_result(torch.ones(1))
    fut.wait()
    assert len(seen) == 1 and seen[0] is like


def test_all_of_fails_with_the_inputs_error() -> None:
    like = torch.zeros(3)
    stages: list[int] = []
    fut = _futures.real(
        _futures.after(
            _futures.all_of([_done(like), _failed("allgather over ranks [0, 1] failed")], like),
            lambda v: stages.append(1),
            like,
        )
    )
    # torch wraps a callback's error in a RuntimeError naming its type; its text survives
    with pytest.raises(RuntimeError, match=r"CommError: allgather over ranks \[0, 1\] failed"):
        fut.wait()
    assert not stages  # the decode never ran on a failed collective


@pytest.mark.cuda
def test_all_of_stages_see_work_queued_on_the_inputs_streams() -> None:
    # The input's value is written on a side stream after a long sleep, and its future records
    # that stream's event. A stage chained to collect_all's CPU-only future would run on the
    # default stream, which never waited, and read zeros; all_of's stage must read the ones.
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.zeros(1 << 20, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: far longer than queueing the stage
        t.fill_(1.0)
        fut = _futures.new_future(t)
        fut.set_result(t)  # records an event on `side`
    seen = _futures.real(_futures.after(_futures.all_of([fut], t), lambda _: t.sum(), t))
    assert float(seen.wait()) == t.numel()
    t.record_stream(side)
