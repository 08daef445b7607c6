"""Jobs at once with and without claiming devices, side by side: joblib, 2 jobs at once, 4 jobs x 2 ranks.

    python bench/parallel_jobs.py               # 3 repeats, a 4 x 1024-wide model, 60 steps a job
    python bench/parallel_jobs.py --repeats 1   # a smoke test

(a) as it comes: each job claims its share of the cores (here half), pinned, and its ranks run
its cores / its ranks threads; (b) ``HYDRA_FSDP_CLAIMS=off``: every job splits all cores among its
own ranks, as Lightning's launcher does, so two jobs at once run twice as many threads as there are
cores. The variants alternate, the order swapped every repeat; per repeat the ratio a/b of the sweep's
wall time and of the mean training time of a job (rank 0's ``setup`` of fit to its end of fit, from
bench/probe.py's records). Prints a Markdown table: median (range) of the ratios, < 1: a is faster.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {"claims (a)": None, "HYDRA_FSDP_CLAIMS=off (b)": "off"}


def sweep(claims, width, steps, workdir):
    """One sweep; its wall time and each job's training time (rank 0's), in seconds."""
    records = Path(tempfile.mkdtemp(dir=workdir))
    env = dict(os.environ, BENCH_RECORD_DIR=str(records), MUSHIN_DDP_LAUNCH_DELAY="0")
    env["HYDRA_FSDP_CLAIMS"] = claims or tempfile.mkdtemp(dir=workdir)  # a node of its own
    command = [
        sys.executable, str(HERE / "app.py"), "-m", f"hydra.sweep.dir={records / 'sweep'}",
        "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
        "module._target_=model.Bench",  # importable in a joblib worker, unlike app.py's __main__.Bench
        "module.trial=range(0,4)", f"module.width={width}", "module.depth=4", f"module.steps={steps}",
    ]  # fmt: skip
    started = time.monotonic()
    subprocess.run(command, cwd=HERE, env=env, check=True, capture_output=True, timeout=600)
    wall = time.monotonic() - started
    seen = [json.loads(line) for path in records.glob("*.jsonl") for line in path.read_text().splitlines()]
    begun = {r["job"]: r["time"] for r in seen if r["event"] == "setup" and r["global_rank"] == 0}
    ended = {r["job"]: r["time"] for r in seen if r["event"] == "fit_end" and r["global_rank"] == 0}
    assert sorted(begun) == sorted(ended) == [0, 1, 2, 3], (begun, ended)
    return wall, [ended[job] - begun[job] for job in sorted(begun)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    results = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                wall, trained = sweep(VARIANTS[name], args.width, args.steps, workdir)
                results[name].append((wall, statistics.mean(trained)))
                print(f"repeat {repeat}, {name}: {wall:.1f} s, jobs trained {trained}", file=sys.stderr)
    (a, b) = VARIANTS
    print(f"**4 jobs x 2 ranks, joblib n_jobs=2, {os.cpu_count()} cores** ({args.repeats} repeats)\n")
    print(f"| figure | {a} | {b} | a/b |\n|---|---|---|---|")
    for index, figure in enumerate(("sweep wall time", "a job's training time (mean)")):
        ratios = [x[index] / y[index] for x, y in zip(results[a], results[b])]
        median = [statistics.median(r[index] for r in results[name]) for name in (a, b)]
        print(
            f"| {figure} | {median[0]:.1f} s | {median[1]:.1f} s | {statistics.median(ratios):.2f}"
            f" ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
