#!/usr/bin/env python3
"""Pick a small seed corpus for one fuzz target from a large one.

Usage: fuzz-pick-seeds.py BINARY OUT_DIR [--max N] [--max-size BYTES] CORPUS_DIR...

BINARY is the target's libFuzzer binary (fuzz/target/<triple>/release/<target>).
libFuzzer's merge (`-merge=1 -merge_control_file=F`) replays every input of the
CORPUS_DIRs and records the coverage features each one reaches. Inputs are then
picked greedily, each time the one adding the most edges (counters) not yet
covered (ties: the most new finer features, i.e. hit-count buckets, then the
smaller input), until N inputs (default 200) are chosen or every edge the
corpus reaches is covered. Inputs larger than --max-size (4096) are left out,
so the committed corpus stays small. The picks replace the earlier picks in
OUT_DIR (files named by the first 16 hex digits of their SHA-1); hand-written
seeds (any other name) stay. Prints the edges and features the picks cover
out of all the corpus reaches.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile


HEX_NAME = re.compile(r"[0-9a-f]{16}")


def merge_features(binary, dirs):
    """Runs libFuzzer's merge; returns ({path: features}, {path: edges})."""
    with tempfile.TemporaryDirectory(prefix="fuzz-pick-") as tmp:
        ctl = os.path.join(tmp, "control")
        empty = os.path.join(tmp, "empty")
        os.mkdir(empty)
        cmd = [binary, "-merge=1", f"-merge_control_file={ctl}", "-timeout=10", empty, *dirs]
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            sys.exit(f"merge failed ({r.returncode}):\n{r.stderr[-2000:]}")
        with open(ctl) as f:
            lines = f.read().splitlines()
    n_files = int(lines[0])
    files = lines[2 : 2 + n_files]
    # "FT i f..." lists every feature input i reaches ("COV" lines only list PCs
    # new in merge order, so they are not used). A counter feature is
    # (counter index << 3 | hit-count bucket): `f >> 3` is the edge.
    features, edges = {}, {}
    for line in lines[2 + n_files :]:
        parts = line.split()
        if parts and parts[0] == "FT":
            path = files[int(parts[1])]
            features[path] = {int(f) for f in parts[2:]}
            edges[path] = {f >> 3 for f in features[path]}
    return features, edges


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("out")
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--max", type=int, default=200)
    ap.add_argument("--max-size", type=int, default=4096)
    a = ap.parse_args()

    features, edges = merge_features(a.binary, a.dirs)
    all_features = set().union(*features.values()) if features else set()
    all_edges = set().union(*edges.values()) if edges else set()
    sizes = {p: os.path.getsize(p) for p in features}
    # Ranked by new edges, then new finer features, then size.
    candidates = [p for p in features if sizes[p] <= a.max_size]
    got_edges, got_ft, picks = set(), set(), []
    while len(picks) < a.max and candidates:
        def gain(p):
            return (len(edges.get(p, set()) - got_edges), len(features[p] - got_ft), -sizes[p])
        best = max(candidates, key=gain)
        if gain(best)[0] == 0:
            break
        picks.append(best)
        candidates.remove(best)
        got_edges |= edges.get(best, set())
        got_ft |= features[best]

    picked = [open(p, "rb").read() for p in picks]
    # Earlier picks (16 hex digits) make way; hand-written seeds (any other
    # name) stay, and a pick identical to one of them is not added twice.
    os.makedirs(a.out, exist_ok=True)
    kept = set()
    for name in os.listdir(a.out):
        path = os.path.join(a.out, name)
        if HEX_NAME.fullmatch(name):
            os.remove(path)
        else:
            kept.add(open(path, "rb").read())
    total = 0
    for data in picked:
        if data in kept:
            continue
        total += len(data)
        with open(os.path.join(a.out, hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
            f.write(data)
    print(
        f"{len(picks)} seeds, {total} bytes: {len(got_edges)} of {len(all_edges)} edges, "
        f"{len(got_ft)} of {len(all_features)} features of the {len(features)} inputs"
    )


if __name__ == "__main__":
    main()
