"""CUDA streams seen from future callbacks: keeping tensors alive, waiting for the gradients.

Callbacks of CUDA-aware futures run on side streams taken from torch's pools; the helpers here
make the caching allocator and those streams see the work queued on the hook's own stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["keep", "resume"]


def keep(*tensors: torch.Tensor) -> None:
    """Tell the caching allocator that ``tensors`` are used on the current stream.

    Callbacks run on side streams; a tensor made on the hook's stream, read in a callback and
    then freed would otherwise be handed to the next allocation on its own stream (the next
    bucket's wire buffer, say) while the callback's kernel may not have read it yet."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(_current_stream(t.get_device()))


_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def _current_stream(device: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` from a cache: its Python layers cost ~25 µs per
    call on the H100 machine's host (cProfile), paid per bucket. Callback streams come from
    torch's fixed per-device pools, so the cache stays small."""
    key = torch._C._cuda_getCurrentStream(device)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(
            stream_id=key[0], device_index=key[1], device_type=key[2]
        )
    return stream


def resume(fn: Callable[[], Any], t: torch.Tensor) -> Callable[[Any], Any]:
    """``fn`` to run later in a callback; on CUDA it first waits for the work queued so far
    on the current stream (the gradients of ``t``), which the callback's stream has not seen."""
    if t.device.type != "cuda":
        return lambda _: fn()
    event = torch.cuda.Event()
    event.record()

    def run(_: Any) -> Any:
        torch.cuda.current_stream().wait_event(event)
        return fn()

    return run
