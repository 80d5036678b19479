"""Single-process fakes for hook tests: a 2-rank process group that records its calls, buckets."""

from __future__ import annotations

import torch

from aiak.comm import _collectives


class CountingGroup(torch.distributed.ProcessGroup):
    """A 2-rank group whose peer contributes what we do: records each call's kind and size."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(0, 2)
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def _work(self, kind: str, tensors: list[torch.Tensor]):
        from torch._C._distributed_c10d import _create_work_from_future

        self.calls.append((kind, len(tensors)))
        fut = torch.futures.Future()
        if self.fail:  # a real error of the future (set_exception stores it as the value)

            def gone(_):
                raise RuntimeError("peer 1 is gone")

            out = fut.then(gone)
        else:
            for t in tensors:
                t.mul_(2)  # SUM over two ranks holding the same values
            out = fut
        fut.set_result(tensors)
        return _create_work_from_future(out)

    def allreduce(self, tensors, opts=None):
        return self._work("allreduce", tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._work("coalesced", tensors)


class IndexedBucket:
    """Bucket ``i`` of ``n``: a flat buffer, its index, whether it is the last."""

    def __init__(self, i: int, n: int, length: int) -> None:
        self.buf = torch.arange(length, dtype=torch.float) + 0.25 * i
        self.i, self.n = i, n

    def buffer(self) -> torch.Tensor:
        return self.buf

    def index(self) -> int:
        return self.i

    def is_last(self) -> bool:
        return self.i == self.n - 1


def ready(hook, group: CountingGroup, coalesce: int = 1):
    state = hook.state
    state.coalesce = coalesce
    state._link = _collectives.Link(group, (0, 1), inter=False)
    state._link._avg = False  # gloo's path: divide, then SUM
    state._batch = _collectives.Batch() if coalesce > 1 else None
    state._ready = True
    return state
