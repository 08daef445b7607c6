"""Memory of loading a full checkpoint under HydraFSDP: its memory-mapped load against Lightning's lazy one.

    python bench/checkpoint_memory.py                 # 3 interleaved repeats, 50.4M parameters
    python bench/checkpoint_memory.py --repeats 5 --depth 24

Writes two full checkpoints of bench/ckpt_app.py's 12 x Linear(2048, 2048) model with HydraFSDP
on 2 CPU ranks: one of a module with plain hyperparameters, one of the template's shape (its
``net`` kept in the hyperparameters). Then runs ``trainer.test(ckpt_path=...)`` on 2 ranks, each
variant once per repeat in a rotated order, sampling every 10 ms the PSS of every process of the
run (rank 0, the fork server, the child rank) and keeping the peak of their sum:

- ``no checkpoint``: the same test with the module's own weights: what the run costs without a load;
- ``lightning lazy``: Lightning's FSDPStrategy.load_checkpoint (``_lazy_load``), plain hyperparameters;
- ``hydra_fsdp``: HydraFSDP's own load (``torch.load(mmap=True)``), plain hyperparameters;
- ``no checkpoint, net`` and ``hydra_fsdp, net``: the same two, of the template-shaped module
  (``save_hyperparameters`` keeps a deep copy of its ``net``: a second model's worth a rank);
- ``lightning lazy, net``: expected to fail (a Parameter pickled in the hyperparameters).

Ratios are per repeat, against ``lightning lazy`` of the same repeat.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APP = Path(__file__).resolve().parent / "ckpt_app.py"
SAMPLE_EVERY = 0.01
TIMEOUT = 600
VARIANTS = {
    "no checkpoint": ("plain", "hydra_fsdp", False),
    "lightning lazy": ("plain", "lightning_lazy", True),
    "hydra_fsdp": ("plain", "hydra_fsdp", True),
    "no checkpoint, net": ("net", "hydra_fsdp", False),
    "hydra_fsdp, net": ("net", "hydra_fsdp", True),
    "lightning lazy, net": ("net", "lightning_lazy", True),
}


def tree(root: int) -> list:
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent_of[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parent_of.items() if parent in frontier]
        found += frontier
    return found


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def measured(command: list, env: dict, cwd: Path) -> dict:
    """Run ``command``, sampling the summed PSS of its processes; its exit code and peak (MiB)."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 - read after the run, closed with the process
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    peak, started = 0, time.monotonic()
    try:
        while proc.poll() is None:
            if time.monotonic() - started > TIMEOUT:
                raise TimeoutError(f"{' '.join(command)} ran over {TIMEOUT} s")
            peak = max(peak, sum(pss_kib(pid) for pid in tree(proc.pid)))
            time.sleep(SAMPLE_EVERY)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.seek(0)
    output = log.read().decode(errors="replace")
    return {"code": proc.returncode, "peak_mib": peak / 1024, "output": output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=12)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt_memory_"))
    # the template-shaped checkpoint pickles an nn.Module: allowed here as a user allows it
    env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    app = [sys.executable, str(APP), f"depth={args.depth}"]
    for kind in ("plain", "net"):
        written = measured([*app, "write=true", f"keep_net={kind == 'net'}", f"ckpt={work / kind}.ckpt",
                            f"hydra.run.dir={work / 'write' / kind}"], env, work)  # fmt: skip
        assert written["code"] == 0, written["output"][-3000:]
    size = (work / "plain.ckpt").stat().st_size / 2**20
    print(f"checkpoints: {size:.0f} MiB each, {args.depth} x Linear(2048, 2048), 2 CPU ranks, in {work}")
    results = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            kind, strategy, load = VARIANTS[name]
            ckpt = f"ckpt={work / kind}.ckpt" if load else "ckpt=null"
            run_dir = f"hydra.run.dir={work / 'test' / f'{repeat}_{name}'.replace(' ', '_').replace(',', '')}"
            result = measured(
                [*app, f"keep_net={kind == 'net'}", f"strategy={strategy}", ckpt, run_dir], env, work
            )
            results[name].append(result)
            print(
                f"  repeat {repeat} {name}: exit {result['code']}, peak {result['peak_mib']:.0f} MiB",
                flush=True,
            )
    for kind in ("", ", net"):
        added = [
            run["peak_mib"] - base["peak_mib"]
            for run, base in zip(results[f"hydra_fsdp{kind}"], results[f"no checkpoint{kind}"])
        ]
        print(
            f"hydra_fsdp{kind}: the load adds {statistics.median(added):.0f} MiB to the run without one"
            f" (median; {min(added):.0f} to {max(added):.0f})"
        )
    print(
        f"\npeak PSS summed over the run's processes, MiB: median (range) of {args.repeats}; ratio per repeat"
    )
    print("| variant | exits | peak MiB | / lightning lazy |\n|---|---|---|---|")
    lazy = results["lightning lazy"]
    for name, runs in results.items():
        peaks = [r["peak_mib"] for r in runs]
        ratios = [r["peak_mib"] / base["peak_mib"] for r, base in zip(runs, lazy)]
        exits = ",".join(str(r["code"]) for r in runs)
        print(f"| {name} | {exits} | {statistics.median(peaks):.0f} ({min(peaks):.0f}-{max(peaks):.0f}) |"
              f" {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")  # fmt: skip
    failed = next((r for r in results["lightning lazy, net"] if r["code"] != 0), None)
    if failed is not None:
        error = [line for line in failed["output"].splitlines() if "Error" in line][-1:]
        print(f"\nlightning lazy, net fails as expected: {error[0].strip() if error else '(no error line)'}")


if __name__ == "__main__":
    main()
