#!/usr/bin/env python3
"""Compare the kernels' PTX of two trees, for refactors of the CUDA sources (no GPU needed).

1. With each tree's `cpu_side` test binary (cargo test --release -p veloxquant-cuda --test
   cpu_side --no-run), write a digest of every module configuration and save the PTX of the
   families to inspect:
     VELOXQUANT_PTX_DIGEST=before.txt VELOXQUANT_PTX_SAVE=before/ ./cpu_side every_kernel
   (VELOXQUANT_PTX_ONLY=S keeps the module keys containing S; LD_LIBRARY_PATH must reach a
   libnvrtc, e.g. the nvidia-cuda-nvrtc wheel's.)
2. python3 ptx_compare.py before.txt after.txt before/ after/
   counts the modules whose PTX is byte-identical, then compares each differing one kernel by
   kernel as multisets of instructions with registers and labels renamed: "same up to order"
   means the two differ only in instruction order and register numbering; the rest are
   grouped by what differs, for review.
"""
import collections
import os
import re
import sys


def entries(path):
    """Kernel entry -> multiset of normalized instructions."""
    out, cur = {}, None
    with open(path) as f:
        for line in f:
            m = re.match(r"\.(visible )?\.entry (\w+)", line)
            if m:
                cur = m.group(2)
                out[cur] = collections.Counter()
                continue
            s = line.strip()
            if cur is None or not s or s.startswith("//"):
                continue
            s = re.sub(r"%(rd|r|f|p|rs|fd|h|hh)\d+", r"%\1", s)
            s = re.sub(r"\$L__BB\d+_\d+", "L", s)
            s = re.sub(r"\.reg \.(\w+)\s+%\w+<\d+>", r".reg .\1", s)
            out[cur][s] += 1
    return out


def differences(a_path, b_path):
    """A tuple describing how the two PTX files differ beyond order and names (() if not)."""
    a, b = entries(a_path), entries(b_path)
    rows = []
    for k in sorted(set(a) | set(b)):
        ca, cb = a.get(k, collections.Counter()), b.get(k, collections.Counter())
        if ca != cb:
            rows.append(f"{k}: -{sum((ca - cb).values())} +{sum((cb - ca).values())}")
            rows += [f"  - {n} {s}" for s, n in sorted((ca - cb).items())]
            rows += [f"  + {n} {s}" for s, n in sorted((cb - ca).items())]
    return tuple(rows)


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    load = lambda p: dict(line.split() for line in open(p))
    before, after = load(sys.argv[1]), load(sys.argv[2])
    if set(before) != set(after):
        print(f"the trees build different configurations: {len(set(before) ^ set(after))} keys differ")
    common = sorted(set(before) & set(after))
    diff = [k for k in common if before[k] != after[k]]
    print(f"{len(common)} configurations: {len(common) - len(diff)} byte-identical PTX, {len(diff)} differ")
    groups, same, missing = collections.Counter(), 0, []
    for k in diff:
        name = k.replace("/", "_") + ".ptx"
        pa, pb = os.path.join(sys.argv[3], name), os.path.join(sys.argv[4], name)
        if not (os.path.exists(pa) and os.path.exists(pb)):
            missing.append(k)
            continue
        d = differences(pa, pb)
        if d:
            groups[d] += 1
        else:
            same += 1
    print(f"of those: {same} the same up to instruction order and register names; "
          f"{sum(groups.values())} differ otherwise; {len(missing)} not saved")
    for d, n in groups.most_common():
        print(f"{n} modules:\n  " + "\n  ".join(d))


if __name__ == "__main__":
    main()
