"""Images/s of preprocess.py --images vs. a plain loop of Pillow open/convert/resize/crop.

Run (from the repo root):
    python bench/bench_images.py                      # makes 1,000 JPEGs in /tmp/bench_images
Both sides decode the same ImageFolder of JPEGs (500x375, quality 90; smooth random shapes plus
noise, so that files are photo-sized, not incompressible noise) to 224 x 224 RGB. The loop does
only that, in one process; the pipeline also computes the channel statistics, writes the Arrow
shards and meta.json, with --workers processes. Rounds alternate so that a machine busy with
something else slows both alike; the best round of each is reported.
"""
import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import preprocess  # noqa: E402  (the repo root is not on sys.path for bench/bench_images.py)


def make_image(path):
    """One JPEG of 500x375, its pixels drawn from a generator seeded by its index."""
    rng = np.random.default_rng(int(path.stem))
    coarse = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((500, 375), Image.Resampling.BICUBIC), np.int16)
    noisy = smooth + rng.integers(-12, 13, smooth.shape, dtype=np.int16)
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def make_folder(root, count, workers):
    """count JPEGs of 500x375 in root/class_0 .. class_9, unless they are there already."""
    paths = [root / f"class_{i % 10}" / f"{i:05d}.jpg" for i in range(count)]
    missing = [path for path in paths if not path.exists()]
    for path in missing:
        path.parent.mkdir(parents=True, exist_ok=True)
    with multiprocessing.Pool(workers) as pool:
        pool.map(make_image, missing, chunksize=64)
    return paths


def plain_loop(paths, size):
    for path in paths:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        width, height = rgb.size
        new_size = (size, size * height // width) if width <= height else \
            (size * width // height, size)
        resized = rgb.resize(new_size, Image.Resampling.BICUBIC)
        left, top = (new_size[0] - size) // 2, (new_size[1] - size) // 2
        np.asarray(resized.crop((left, top, left + size, top + size))).tobytes()
    return len(paths)


def pipeline(root, size, workers):
    source = preprocess.path_source(root)
    with tempfile.TemporaryDirectory() as out_dir:
        result = preprocess.write_image_shards(source, Path(out_dir), size, 0.1, workers)
    return sum(split["images"] for split in result["splits"].values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/bench_images", help="(%(default)s; the JPEGs go to "
                        "DIR/N_images)")
    parser.add_argument("--images", type=int, default=1000, help="(%(default)s)")
    parser.add_argument("--image-size", type=int, default=224, help="(%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="(%(default)s)")
    parser.add_argument("--loop-images", type=int, default=0, help="the loop times only the "
                        "first N files (its rate is the same on any N of these files; 0: all)")
    parser.add_argument("--json", action="store_true", help="print a RESULT line of JSON last")
    parser.add_argument("--skip-one-worker", action="store_true", help="leave out the pipeline "
                        "with one worker (on many files, the longest side)")
    args = parser.parse_args()
    root = Path(args.dir) / f"{args.images}_images"  # the pipeline reads the whole folder
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    paths = make_folder(root, args.images, cpus)
    megabytes = sum(path.stat().st_size for path in paths) / 1e6
    loop_paths = paths[:args.loop_images] if args.loop_images else paths
    sides = {"Pillow loop, 1 process": lambda: plain_loop(loop_paths, args.image_size),
             **({} if args.skip_one_worker else
                {"preprocess.py, 1 worker": lambda: pipeline(root, args.image_size, 1)}),
             f"preprocess.py, {cpus} workers": lambda: pipeline(root, args.image_size, cpus)}

    best = {}
    for round_index in range(args.rounds):
        rates = []
        for name, run in sides.items():
            start = time.perf_counter()
            images = run()
            seconds = time.perf_counter() - start
            rates.append(f"{images / seconds:.0f}")
            if name not in best or seconds < best[name][1]:
                best[name] = (images, seconds)
        print(f"round {round_index + 1}: images/s " + ", ".join(rates), file=sys.stderr)

    baseline_images, baseline_seconds = best["Pillow loop, 1 process"]
    print(f"{len(paths):,} JPEGs of 500x375 ({megabytes:.0f} MB) to {args.image_size} x "
          f"{args.image_size}; best of {args.rounds} rounds; {cpus} CPUs; Pillow {PIL.__version__}")
    print(f"{'method':<28} {'images':>7} {'seconds':>8} {'images/s':>9} {'vs loop':>8}")
    for name, (images, seconds) in best.items():
        print(f"{name:<28} {images:7,} {seconds:8.2f} {images / seconds:9.0f} "
              f"{images / seconds / (baseline_images / baseline_seconds):7.2f}x")
    if args.json:
        many = best[f"preprocess.py, {cpus} workers"]
        print("RESULT " + json.dumps({
            "images": len(paths), "megabytes": round(megabytes), "cpus": cpus,
            "loop_images": baseline_images, "pillow": PIL.__version__,
            "loop_images_per_sec": round(baseline_images / baseline_seconds, 1),
            "one_worker_images_per_sec": None if args.skip_one_worker else round(
                best["preprocess.py, 1 worker"][0] / best["preprocess.py, 1 worker"][1], 1),
            "pipeline_images_per_sec": round(many[0] / many[1], 1),
            "pipeline_seconds": round(many[1], 2)}))


if __name__ == "__main__":
    main()
