#!/usr/bin/env bash
# Old against new on one machine: benchmarks/<bench>.py of git revision OLD_REV and of this
# working tree, interleaved (old, new, old, new), each run its own process. The old tree is
# unpacked under a temporary folder and imported through PYTHONPATH ahead of the installed
# (editable) aiak, so both sides run the same benchmark code of their own revision.
#   research/ab_bench.sh OLD_REV [BENCH ...]      default: bench_optim bench_multi_tensor
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: research/ab_bench.sh OLD_REV [BENCH ...]}
shift
benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=(bench_optim bench_multi_tensor)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src" "$tmp/pkg/aiak"
git archive "$old" | tar -x -C "$tmp/src"
for d in ops optim amp comm data launch conformance; do ln -s "$tmp/src/$d" "$tmp/pkg/aiak/$d"; done
PYTHONPATH="$tmp/pkg" python3 -c "import aiak.ops as o; assert o.__file__.startswith('$tmp'), o.__file__"
for round in 1 2; do
  for b in "${benches[@]}"; do
    echo "=== round $round old ($old) $b"
    (cd "$tmp/src" && PYTHONPATH="$tmp/pkg" python3 "benchmarks/$b.py") || echo "(exit $?)"
    echo "=== round $round new (working tree) $b"
    python3 "benchmarks/$b.py" || echo "(exit $?)"
  done
done
