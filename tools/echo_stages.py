#!/usr/bin/env python3
"""Where one back-to-back call's time goes, stage by stage, in both processes.

Reads the stamp files (DIR/stages.<pid>) that a build with
-DTANDEM_STAGE_STAMPS=ON writes when $TANDEM_STAGES=DIR is set
(rpc/stages.h), e.g.

  cmake -S . -B build-stages -G Ninja -DTANDEM_STAGE_STAMPS=ON -DTANDEM_BUILD_TESTS=OFF
  cmake --build build-stages --target rpc_bench
  mkdir -p /tmp/st && TANDEM_STAGES=/tmp/st build-stages/bin/rpc_bench \
      --sizes 0 --transports shm --rounds 1 --idle-s 0 --iters 20000
  tools/echo_stages.py /tmp/st

The caller is the process with the most call starts. Each call is the run
of stamps from one call start to the next, both processes' stamps merged on
the shared clock; the first and last tenth are dropped (start-up, the other
benches). Of the calls that took the most common path, it prints the median
time of each stage since the call started, and the step from the one before.
"""
import collections
import glob
import statistics
import sys

NAMES = {
    1: "call start", 2: "call encoded", 3: "published", 4: "ring read", 5: "delivered",
    6: "request taken", 7: "handler in", 8: "handler out", 9: "reply encoded",
    10: "call done", 11: "spin done", 12: "returned", 13: "pool taken", 14: "pool posted",
    15: "backward start", 16: "runs sent", 17: "grads sent", 18: "grads taken", 19: "part start",
    20: "drain start", 21: "part done", 22: "backward end",
}
CALL_START = 1


def main(folder):
    stamps = []
    files = glob.glob(folder + "/stages.*")
    if len(files) != 2:
        sys.exit(f"echo_stages: want two stamp files (caller, callee) in {folder}, found {len(files)}")
    for path in files:
        pid = int(path.rsplit(".", 1)[1])
        with open(path) as f:
            for line in f:
                stage, thread, ns = map(int, line.split())
                stamps.append((ns, pid, stage, thread))
    stamps.sort()
    starts = collections.Counter(pid for _, pid, stage, _ in stamps if stage == CALL_START)
    if not starts:
        sys.exit("echo_stages: no call starts: was the build configured with TANDEM_STAGE_STAMPS=ON?")
    caller = starts.most_common(1)[0][0]
    calls, current = [], None
    for ns, pid, stage, thread in stamps:
        if pid == caller and stage == CALL_START:
            if current:
                calls.append(current)
            current = (ns, [])
        if current:
            current[1].append((ns - current[0], "caller" if pid == caller else "callee", stage, thread))
    cut = len(calls) // 10
    calls = calls[cut:len(calls) - cut]
    paths = collections.Counter(tuple((side, st) for _, side, st, _ in c[1]) for c in calls)
    path, n = paths.most_common(1)[0]
    print(f"{len(calls)} calls; {n} ({100.0 * n / len(calls):.1f}%) took the most common path:")
    chosen = [c[1] for c in calls if tuple((side, st) for _, side, st, _ in c[1]) == path]
    before = 0.0
    for i, (side, stage) in enumerate(path):
        at = statistics.median(c[i][0] for c in chosen) / 1000.0
        print(f"  {side:6} {NAMES.get(stage, str(stage)):14} {at:8.2f} us  (+{at - before:5.2f})")
        before = at


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
