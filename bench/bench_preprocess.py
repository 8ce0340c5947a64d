"""Throughput of preprocess.py's tokenize stage vs. a loop calling `tokenizer.encode` per document.

Run (from the repo root, after `python preprocess.py` has trained data/stdlib/tokenizer.json):
    python bench/bench_preprocess.py
Both sides read the same default corpus (the standard library's *.py files) from disk in the same
process; the loop only counts tokens, while the pipeline also builds the Arrow rows and writes the
shards. Rounds alternate so that a machine busy with something else slows both alike; the best
round of each is reported.
"""
import argparse
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import preprocess  # noqa: E402  (the repo root is not on sys.path for bench/bench_preprocess.py)


def per_document_loop(tokenizer, sources):
    text_bytes = tokens = 0
    for _, text, document_bytes in preprocess.iter_documents(sources, "text", "text", Counter()):
        # + eot, as the pipeline stores
        tokens += len(tokenizer.encode(text, add_special_tokens=False).ids) + 1
        text_bytes += document_bytes
    return text_bytes, tokens


def pipeline(tokenizer, sources):
    with tempfile.TemporaryDirectory() as out_dir:
        documents = preprocess.iter_documents(sources, "text", "text", Counter())
        result = preprocess.write_shards(documents, tokenizer, Path(out_dir), 0.02, 100_000_000)
    return result["text_bytes"], sum(split["tokens"] for split in result["splits"].values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="data/stdlib/tokenizer.json", help="(%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="(%(default)s)")
    args = parser.parse_args()
    sources = preprocess.stdlib_sources()
    if Path(args.tokenizer).is_file():
        tokenizer = preprocess.load_tokenizer(args.tokenizer)
    else:
        print(f"{args.tokenizer} not found: training one as preprocess.py would (vocab 8192)")
        documents = preprocess.iter_documents(sources, "text", "text", Counter())
        tokenizer = preprocess.train_tokenizer(documents, 8192, len(sources))
    tokenizer.encode_special_tokens = True  # as in preprocess.py

    best = {}
    for round_index in range(args.rounds):
        speeds = []
        for name, run in (("per-document encode loop", per_document_loop),
                          ("preprocess.write_shards", pipeline)):
            start = time.perf_counter()
            text_bytes, tokens = run(tokenizer, sources)
            seconds = time.perf_counter() - start
            speeds.append(text_bytes / 1e6 / seconds)
            if name not in best or seconds < best[name][2]:
                best[name] = (text_bytes, tokens, seconds)
        print(f"round {round_index + 1}: loop {speeds[0]:.2f} MB/s, pipeline {speeds[1]:.2f} MB/s, "
              f"{speeds[1] / speeds[0]:.2f}x", file=sys.stderr)

    baseline_seconds = best["per-document encode loop"][2]
    # taskset-aware
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{len(sources)} files of the Python {platform.python_version()} standard library; best "
          f"of {args.rounds} rounds; {cpus} CPUs; tokenizers {tokenizers.__version__}")
    print(f"{'method':<26} {'MB':>6} {'tokens':>11} {'seconds':>8} {'MB/s':>6} {'vs loop':>8}")
    for name, (text_bytes, tokens, seconds) in best.items():
        print(f"{name:<26} {text_bytes / 1e6:6.1f} {tokens:11,} {seconds:8.2f} "
              f"{text_bytes / 1e6 / seconds:6.2f} {baseline_seconds / seconds:7.2f}x")


if __name__ == "__main__":
    main()
