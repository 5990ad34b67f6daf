#!/usr/bin/env python3
"""Trims minimized corpora to what is committed: at most BYTES bytes per
target, the largest inputs going first (seeds named `seed-*` are always
kept). Run after `cargo fuzz cmin <target>`: a minimized corpus is already
one input per piece of coverage, so what this drops is the coverage only
large inputs reach (GGUF files with many tensors, whole plugins), which
fuzzing from the seeds finds again.

    python3 fuzz/trim.py [TARGET...]     # every target under fuzz/corpus/ when none
"""
import os
import sys

BYTES = 1_500_000
corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
targets = sys.argv[1:] or sorted(os.listdir(corpus))
for target in targets:
    folder = os.path.join(corpus, target)
    names = sorted(os.listdir(folder))
    size = {n: os.path.getsize(os.path.join(folder, n)) for n in names}
    seeds = [n for n in names if n.startswith("seed-")]
    others = sorted((n for n in names if not n.startswith("seed-")), key=lambda n: (size[n], n))
    kept, total = set(seeds), sum(size[n] for n in seeds)
    for n in others:
        if total + size[n] > BYTES:
            break
        kept.add(n)
        total += size[n]
    for n in names:
        if n not in kept:
            os.remove(os.path.join(folder, n))
    print(f"{target}: kept {len(kept)} of {len(names)} inputs, {total} bytes")
