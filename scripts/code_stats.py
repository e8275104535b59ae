#!/usr/bin/env python3
"""Figures of the code's shape that docs/architecture.md quotes, recomputable at any commit:

    python3 scripts/code_stats.py [REPO_DIR]          # default: this checkout

- lines of C++ (.cc and .h, tests apart) per folder of coordinator/, worker/, client/, common/,
  planner/, trainer/ (one level down: coordinator/scheduling, trainer/model, ...);
- the ten largest non-test C++ files;
- uses of the coordinator's shared ClusterState fields (nodes, allocations, notifier,
  heartbeat_node, mu, node_write_mu through `state->`, `state_->` or a `state.` reference) outside
  cluster_state.{h,cc}, by file, in the parts that hold a ClusterState (coordinator/cluster/, or a file whose .h or
  .cc names it; other classes' own `state->mu` are not counted): each is a part reading or writing
  state it does not own;
- where the cluster lock is taken: the GuardedLedger::Hold objects made outside
  guarded_ledger.h, by file (tests apart): the parts that read or change the live attempts;
- sleeps in tests (std::this_thread::sleep_for, absl::SleepFor, usleep in *_test.cc and tests/).
"""

import collections
import os
import re
import sys

FOLDERS = ("coordinator", "worker", "client", "common", "planner", "trainer")
STATE_USE = re.compile(
    r"\bstate_?(?:->|\.)(nodes|allocations|notifier|heartbeat_node|mu|node_write_mu)\b")
HOLD = re.compile(r"\bGuardedLedger::Hold\s+\w+\s*\(")
SLEEP = re.compile(r"sleep_for\s*\(|SleepFor\s*\(|\busleep\s*\(")


def cxx_files(root):
    for folder in FOLDERS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
            dirnames[:] = [d for d in dirnames if d not in ("build", "__pycache__")]
            for name in filenames:
                if name.endswith((".cc", ".h")):
                    yield os.path.relpath(os.path.join(dirpath, name), root)


def is_test(path):
    name = os.path.basename(path)
    return (name.endswith(("_test.cc", "_fixture.h", "_fake.h", "_golden.h")) or
            "/testing/" in path or name.startswith("test_"))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))
    lines = {}
    for path in cxx_files(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            lines[path] = f.read().splitlines()
    by_folder = collections.defaultdict(lambda: [0, 0, 0, 0])
    for path, text in lines.items():
        parts = path.split(os.sep)
        folder = os.sep.join(parts[:2]) if len(parts) > 2 else parts[0]
        entry = by_folder[folder]
        if is_test(path):
            entry[2] += 1
            entry[3] += len(text)
        else:
            entry[0] += 1
            entry[1] += len(text)
    print("C++ by folder: files, lines (tests: files, lines)")
    for folder in sorted(by_folder):
        f, n, tf, tn = by_folder[folder]
        print(f"  {folder:<28} {f:4d} {n:7d}   ({tf:3d} {tn:6d})")
    print("largest non-test files (lines)")
    largest = sorted(((len(t), p) for p, t in lines.items() if not is_test(p)), reverse=True)
    for count, path in largest[:10]:
        print(f"  {count:6d}  {path}")
    uses = collections.Counter()
    for path, text in lines.items():
        if is_test(path) or not path.startswith("coordinator"):
            continue
        if os.path.basename(path) in ("cluster_state.h", "cluster_state.cc"):
            continue
        stem = os.path.splitext(path)[0]
        if not path.startswith("coordinator/cluster/") and not any(
                re.search(r"\bClusterState\b", "\n".join(lines.get(stem + ext, [])))
                for ext in (".h", ".cc")):
            continue
        for line in text:
            uses[path] += len(STATE_USE.findall(line))
    total = sum(uses.values())
    print(f"ClusterState field uses outside cluster_state.*: {total}")
    for path, count in uses.most_common():
        if count:
            print(f"  {count:4d}  {path}")
    holds = collections.Counter()
    for path, text in lines.items():
        if is_test(path) or os.path.basename(path) == "guarded_ledger.h":
            continue
        holds[path] += sum(len(HOLD.findall(line)) for line in text)
    print(f"cluster lock holds (GuardedLedger::Hold) outside guarded_ledger.h: "
          f"{sum(holds.values())}")
    for path, count in holds.most_common():
        if count:
            print(f"  {count:4d}  {path}")
    sleeps = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "build"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if not (name.endswith("_test.cc") or (rel.startswith("tests" + os.sep) and
                                                   name.endswith((".cc", ".h")))):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                sleeps += sum(len(SLEEP.findall(line)) for line in f
                              if not line.lstrip().startswith("//"))
    print(f"sleeps in tests: {sleeps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
