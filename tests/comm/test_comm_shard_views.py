"""Shard views: what hierarchical hands its outer hook."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from aiak.comm import _buckets

# ------------------------------------------------------------------------------------------
# shard views (what hierarchical hands its outer hook)
# ------------------------------------------------------------------------------------------


class FakeBucket:
    def __init__(self, shapes):
        self.buf = torch.arange(sum(int(torch.Size(s).numel()) for s in shapes), dtype=torch.float)
        self.views, off = [], 0
        for s in shapes:
            n = int(torch.Size(s).numel())
            self.views.append(self.buf[off : off + n].view(s))
            off += n

    def buffer(self):
        return self.buf

    def gradients(self):
        return self.views

    def parameters(self):
        return []

    def index(self):
        return 0

    def is_last(self):
        return True


shapes_st = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 9)),
        st.tuples(st.integers(1, 7), st.integers(1, 7)),
        st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=6,
)


@given(shapes_st, st.integers(1, 5))
def test_shard_views_cover_each_shard_exactly_and_keep_rows(shapes, g):
    bucket = FakeBucket(shapes)
    n = bucket.buf.numel()
    shard_len = -(-n // g)
    padded = torch.cat([bucket.buf, torch.full((shard_len * g - n,), -1.0)])
    for k in range(g):
        shard = padded[k * shard_len : (k + 1) * shard_len].clone()
        sub = _buckets.shard_views(bucket, k * shard_len, shard)
        covered = torch.zeros(shard_len, dtype=torch.int)
        for v in sub.gradients():
            assert v.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
            start = (v.data_ptr() - shard.data_ptr()) // 4
            covered[start : start + v.numel()] += 1
            if v.dim() == 2:  # whole rows of one parameter: row starts are row multiples
                first = int(v[0, 0])
                owner = next(
                    g_
                    for g_ in bucket.views
                    if g_.reshape(-1)[0] <= first < g_.reshape(-1)[0] + g_.numel()
                )
                cols = owner.numel() // owner.shape[0]
                assert v.shape[1] == cols and (first - int(owner.reshape(-1)[0])) % cols == 0
        assert torch.equal(covered, torch.ones(shard_len, dtype=torch.int))
