"""A tiny run of every dgc_select kernel path, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_dgc_select.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_dgc_select.py

The fast count with its candidates; the gated full count (a sample of one outlier walks the
threshold past the fast states) in register and binary-search form; the exact top-k after a
resample stop (a sample of zeros); an unaligned view with ties (scalar loads); sizes with a
partial last tile. Each result is compared with the reference on the CPU; exits non-zero when
one differs.
"""

from __future__ import annotations

import sys

import torch

from aiak.ops.dgc_select import dgc_select


def main() -> int:
    torch.manual_seed(0)
    n = 100_003
    normal = torch.randn(n)
    outlier = normal.clone()
    outlier[0] = 8.06  # 0.8^-4 above the rest of the sample: the 5th state, past the fast count
    zero_at_5 = normal.clone()
    zero_at_5[5] = 0.0  # thr0 = 0: every element counts, the loop stops and resamples
    ties = torch.randn(n + 1)
    ties[::2] = 0.0
    cases = [  # (name, x on the CPU, view offset, k, m, start, stride, sample indices, resample)
        ("fast count", normal, 0, 100, 1000, 0, 100, None, True),
        ("no resample (binary search)", normal, 0, 100, 1000, 0, 100, None, False),
        ("full count", outlier, 0, 100, 1000, 0, 1, torch.zeros(1000, dtype=torch.int64), True),
        ("exact top-k", zero_at_5, 0, 100, 1000, 0, 1, torch.full((1000,), 5), True),
        ("unaligned, ties", ties, 1, 200, 1000, 3, 100, None, True),
    ]
    bad = 0
    for name, x, offset, k, m, start, stride, sidx, resample in cases:
        xc = x[offset:]
        xd = x.cuda()[offset:]
        want = dgc_select(xc, k, m, start, stride, sidx, 1.3, 0.8, 10, resample)
        sd = None if sidx is None else sidx.cuda()
        got = dgc_select(xd, k, m, start, stride, sd, 1.3, 0.8, 10, resample)
        same = all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
        print(f"{name:30s} {'ok' if same else 'DIFFERS'}")
        bad += not same
    torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
