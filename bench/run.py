"""hydra_fsdp benchmarks: ratios measured side by side in one run, printed as Markdown tables.

    python bench/run.py            # N = 1, 4, 16 jobs, 3 repeats; 12M/50M/100M-parameter models (~25 min)
    python bench/run.py --quick    # N = 1, 4, 1 repeat; a 12M model: a smoke test (~3 min on 2 cores)

Every variant is interleaved with the others and the order rotated every repeat; a ratio is taken
per repeat between runs made side by side, and the tables give the median and the range of those
ratios (absolute times only next to them). What it measures:

1. Sweep wall time, N jobs x 2 ranks, a tiny model, 4 steps a job, CPU/gloo:
   a) HydraDDP (``MUSHIN_DDP_LAUNCH_DELAY=0``), as it comes: a fresh child rank for every job,
      forked by the sweep's fork server; the fork server's peak memory is sampled meanwhile;
   b) Lightning's own ``strategy="ddp"`` under the same ``-m`` sweep. Its child runs the sweep's
      argv (plus ``hydra.run.dir=...``, which ``-m`` ignores), i.e. the whole sweep, in lockstep
      with rank 0: from job 1 on, ``LOCAL_RANK`` is left in rank 0's environment, so neither side
      launches anything and both reuse job 0's process group. Wrong in general (the child trains
      its own sweep's config, and a child failure kills the sweep), but never starts a child again;
   c) N runs, one after another, of a plain Hydra-free script with
      ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``.
   The stagger: HydraDDP with ``MUSHIN_DDP_LAUNCH_DELAY`` unset (1 s between two child spawns)
   against 0, at 2 ranks (one child: nothing to wait) and at 4 ranks (three children, two waits).
2. Child-rank start-up: a child's age (from its start time in /proc/<pid>/stat) when Lightning
   calls ``LightningModule.setup``, just after the process group is up, against the floor: the
   age of ``python -c "import torch, pytorch_lightning"`` when its imports are done.
3. HydraFSDP vs HydraDDP at 2 ranks with Adam, models of 12M, 50M and 100M parameters: parameters
   held per rank, peak resident memory per rank (VmHWM), wall time; with glibc's default malloc
   and with a fixed mmap threshold (see ALLOCATORS).
4. How each figure grows with N and with the model size: in the tables above.

The apps: bench/app.py (Hydra, hydra-zen) and bench/plain.py (no Hydra); bench/probe.py is what
they record with. Runs go to a temporary directory, removed at the end unless ``--keep`` (or a
failure). Progress goes to stderr, the Markdown to stdout.

A variant of HydraDDP needs no code: ``--hydra-ddp-extra OVERRIDE`` (a Hydra override,
repeatable) and/or ``--hydra-ddp-extra-env KEY=VALUE`` add variant "a+" = (a) plus those, run
side by side with a, b and c, e.g. the strategy's own bound on collectives::

    python bench/run.py --hydra-ddp-extra "+trainer.strategy.timeout={_target_:datetime.timedelta,seconds:60}"

In code, the variants are declared in ``sweep_variants()``, ``stagger_variants()`` and
``memory_variants()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from probe import read_records

from hydra_fsdp import LAUNCH_DELAY_ENV as DELAY_ENV

APP = BENCH / "app.py"
PLAIN = BENCH / "plain.py"
# The sweep's tiny model: 2 x Linear(32, 32), 4 steps of batch 8 per job.
TINY = {"width": 32, "depth": 2, "batch": 8, "steps": 4}
# The memory models: depth x Linear(2048, 2048); params = depth * (2048**2 + 2048).
MEM_WIDTH = 2048
MEM_BATCH = 8
MEM_STEPS = 3
SAMPLE_EVERY = 0.25  # s between two looks at the fork server's memory
FLOORS = {
    "floor": "import torch, pytorch_lightning",
    "floor_hydra": "import torch, pytorch_lightning, hydra_zen, hydra_fsdp",
}


@dataclasses.dataclass
class Variant:
    key: str
    label: str
    kind: str  # "sweep": one `app.py -m` over N jobs; "plain": plain.py N times, one after another
    overrides: tuple = ()
    env: dict = dataclasses.field(default_factory=dict)  # a value of None unsets the variable
    ranks: int = 2


def sweep_variants(args) -> dict:
    """Every variant the sweep section runs, in one place. (a) is the product."""
    variants = {
        "a": Variant("a", "HydraDDP", "sweep", ("trainer/strategy=hydra_ddp",), {DELAY_ENV: "0"}),
        "b": Variant("b", "stock `ddp`, lockstep", "sweep", ("trainer/strategy=stock_ddp",)),
        "c": Variant("c", "N plain runs", "plain"),
    }
    if args.hydra_ddp_extra or args.hydra_ddp_extra_env:
        extra_env = dict(item.split("=", 1) for item in args.hydra_ddp_extra_env)
        variants["a+"] = Variant(
            "a+",
            args.hydra_ddp_extra_label,
            "sweep",
            variants["a"].overrides + tuple(args.hydra_ddp_extra),
            {**variants["a"].env, **extra_env},
        )
    return {key: variant for key, variant in variants.items() if not args.only or key in args.only}


def stagger_variants() -> dict:
    """HydraDDP at the default stagger (the variable unset: 1 s between child spawns) and at 0."""
    ddp = ("trainer/strategy=hydra_ddp",)
    return {
        "a_d1": Variant("a_d1", "HydraDDP, default delay", "sweep", ddp, {DELAY_ENV: None}),
        "d4_0": Variant("d4_0", "HydraDDP, 4 ranks, delay 0", "sweep", ddp, {DELAY_ENV: "0"}, ranks=4),
        "d4_1": Variant("d4_1", "HydraDDP, 4 ranks, default delay", "sweep", ddp, {DELAY_ENV: None}, ranks=4),
    }


# glibc's default allocator raises its mmap threshold as big blocks are freed, then keeps freed
# memory in its heap: RSS then grows step after step with FSDP's per-layer gather/free cycles. A
# fixed threshold returns big blocks to the OS, so that RSS follows the memory tensors really hold.
ALLOCATORS = {"": "glibc default", "_mmap": "MALLOC_MMAP_THRESHOLD_=131072"}


def memory_variants() -> dict:
    variants = {}
    for suffix, allocator in ALLOCATORS.items():
        env = {DELAY_ENV: "0", "MALLOC_MMAP_THRESHOLD_": "131072" if suffix else None}
        for key, label, strategy in (("ddp", "HydraDDP", "hydra_ddp"), ("fsdp", "HydraFSDP", "hydra_fsdp")):
            variants[key + suffix] = Variant(
                key + suffix, f"{label}, {allocator}", "sweep", (f"trainer/strategy={strategy}",), env
            )
    return variants


# --------------------------------------------------------------------------- running


class Runner:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.count = 0
        self.results: list = []
        self.failures: list = []  # runs that did not finish: left out of the tables
        self.exit_notes: list = []  # runs whose every rank finished, but a process exited non-zero

    def base_env(self) -> dict:
        env = dict(os.environ)
        for key in (
            "MASTER_ADDR",
            "MASTER_PORT",
            "NODE_RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "PL_GLOBAL_SEED",
            DELAY_ENV,
            "MALLOC_MMAP_THRESHOLD_",
        ):
            env.pop(key, None)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        return env

    def new_dir(self, name: str) -> Path:
        self.count += 1
        path = self.workdir / f"{self.count:03d}_{name}"
        (path / "records").mkdir(parents=True)
        return path

    def run(self, variant: Variant, n: int, repeat: int, section: str, model: dict | None = None) -> dict:
        model = model or TINY
        rundir = self.new_dir(f"{section}_{variant.key}_n{n}")
        env = self.base_env()
        env["BENCH_RECORD_DIR"] = str(rundir / "records")
        for key, value in variant.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        if variant.kind == "sweep":
            cmds = [
                [
                    sys.executable,
                    str(APP),
                    "-m",
                    f"module.trial=range(0,{n})",
                    f"trainer.devices={variant.ranks}",
                ]
                + [f"module.{k}={v}" for k, v in model.items()]
                + [f"hydra.sweep.dir={rundir / 'sweep'}", *variant.overrides]
            ]
        else:
            cmds = [
                [sys.executable, str(PLAIN), "--devices", str(variant.ranks), "--trial", str(i)]
                + [a for k, v in model.items() for a in (f"--{k}", str(v))]
                for i in range(n)
            ]
        log = rundir / "output.log"
        wall, exits, error, server_peak = _execute(
            cmds, env, rundir, log, timeout=300 + 60 * n * variant.ranks
        )
        records = read_records(str(rundir / "records"))
        if error is None:
            error = _check_records(records, n, variant.ranks, model["steps"])
        bad = [(i, code, tail) for i, (code, tail) in enumerate(exits) if code != 0]
        exit_note = None
        if bad and error is None:
            # the work was done (every rank of every job finished fit): the time counts, flagged
            exit_note = f"every rank finished fit, but {len(bad)} of {len(exits)} command(s) exited with " + (
                ", ".join(_describe_exit(code) for _, code, _ in bad)
            )
        elif bad:
            error += "; " + ", ".join(_describe_exit(code) for _, code, _ in bad)
        result = {
            "section": section,
            "variant": variant.key,
            "label": variant.label,
            "n": n,
            "ranks": variant.ranks,
            "repeat": repeat,
            "model": model,
            "wall": wall,
            "server_peak_kib": server_peak,
            "error": error,
            "exit_note": exit_note,
            "log": str(log),
            "records": records,
        }
        self.results.append(result)
        status = f"{wall:7.1f} s" + ("" if error is None else f"  FAILED: {error}")
        status += "" if exit_note is None else f"  ({exit_note})"
        _progress(f"[{section} r{repeat + 1}] {variant.label:<34} N={n:<3} x {variant.ranks} ranks {status}")
        what = f"{variant.label}, N={n} x {variant.ranks} ranks, repeat {repeat + 1}"
        if exit_note is not None:
            tail = "\n\n".join(f"command {i + 1}:\n{tail}" for i, _, tail in bad)
            self.exit_notes.append({"what": what, "error": exit_note, "log": str(log), "tail": tail})
            _progress("    " + "\n    ".join(tail.splitlines()))
        if error is not None:
            tail = _tail(log, 40)
            self.failures.append(
                {
                    "what": what,
                    "error": error,
                    "log": str(log),
                    "tail": tail,
                }
            )
            _progress("    " + "\n    ".join(tail.splitlines()))
        return result

    def floor(self, key: str, repeat: int) -> dict:
        code = (
            f"{FLOORS[key]}\nimport sys\nsys.path.insert(0, {str(BENCH)!r})\nfrom probe import process_age\n"
        )
        code += "print(process_age())"
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=self.base_env(),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        wall = time.perf_counter() - start
        error = None if proc.returncode == 0 else f"exit code {proc.returncode}: {proc.stderr[-2000:]}"
        age = float(proc.stdout.split()[-1]) if error is None else None
        result = {
            "section": "startup",
            "variant": key,
            "repeat": repeat,
            "age": age,
            "wall": wall,
            "error": error,
        }
        self.results.append(result)
        _progress(
            f"[startup r{repeat + 1}] {key:<34} age {age if age is None else round(age, 2)} s"
            f" (wall {wall:.2f} s)"
        )
        if error:
            self.failures.append({"what": key, "error": error, "log": "", "tail": ""})
        return result


def _execute(cmds: list, env: dict, cwd: Path, log_path: Path, timeout: float):
    """Run the commands one after another; return the wall time, (exit code, log tail) each, an
    error, and the peak memory of the fork server while they ran ({} if none ran).

    A command that exits non-zero does not stop the next one: whether its work was done is for
    the records to say. Only a timeout stops the run.
    """
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    exits = []
    server_peak: dict = {}
    with open(log_path, "ab") as log:
        for cmd in cmds:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            offset = log.tell()
            # its own session, so that a hung run is ended with all its ranks (and nothing else)
            proc = subprocess.Popen(
                cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                while True:
                    try:
                        code = proc.wait(timeout=min(SAMPLE_EVERY, max(0.01, deadline - time.monotonic())))
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() > deadline:
                            raise
                    for key, kib in _fork_server_memory(proc.pid).items():
                        server_peak[key] = max(server_peak.get(key, 0), kib)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return (
                    time.perf_counter() - start,
                    exits,
                    f"timed out after {timeout:.0f} s and was ended",
                    server_peak,
                )
            except BaseException:  # Ctrl-C: the run is in its own session, so end it here
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            exits.append((code, _tail(log_path, 15, offset) if code else ""))
    return time.perf_counter() - start, exits, None, server_peak


def _fork_server_memory(session: int) -> dict:
    """The fork server's resident (RSS) and proportional (PSS: shared pages split among the
    processes that share them) memory now, in KiB: the process of the run's session whose command
    is ``python .../hydra_fsdp.py`` alone. {} while there is none."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
            if int(fields[3]) != session or len(command) != 2 or not command[1].endswith(b"hydra_fsdp.py"):
                continue
            rollup = (entry / "smaps_rollup").read_text().splitlines()[1:]
        except (OSError, ValueError):
            continue
        kib = {line.split(":")[0]: int(line.split()[1]) for line in rollup if line.endswith("kB")}
        return {"server_rss": kib["Rss"], "server_pss": kib["Pss"]}
    return {}


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def _check_records(records: list, n: int, ranks: int, steps: int) -> str | None:
    """Every rank of every job must have joined the process group and finished its steps."""
    ends = [r for r in records if r["event"] == "fit_end"]
    setups = [r for r in records if r["event"] == "setup"]
    jobs_ranks = {
        (r["job"], r["global_rank"]) for r in ends if r["steps_done"] == steps and r["world"] == ranks
    }
    expected = {(j, k) for j in range(n) for k in range(ranks)}
    if jobs_ranks != expected:
        missing = sorted(expected - jobs_ranks)
        return f"{len(missing)} of {len(expected)} (job, rank) pairs did not finish fit: {missing[:8]}"
    if not all(r["process_group"] for r in setups):
        return "a rank ran setup() without a process group"
    return None


def _tail(path: Path, lines: int, offset: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _rotated(items: list, k: int) -> list:
    k %= max(1, len(items))
    return items[k:] + items[:k]


# --------------------------------------------------------------------------- statistics


def _ok(results, **match) -> list:
    return [r for r in results if r.get("error") is None and all(r.get(k) == v for k, v in match.items())]


def _by_repeat(results, **match) -> dict:
    return {r["repeat"]: r for r in _ok(results, **match)}


def _paired_ratios(results, num: dict, den: dict, value=lambda r: r["wall"]) -> list:
    a, b = _by_repeat(results, **num), _by_repeat(results, **den)
    return [value(a[k]) / value(b[k]) for k in sorted(a.keys() & b.keys()) if value(b[k])]


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt_ratio(values: list, digits: int = 2, unit: str = "") -> str:
    """The median of ``values`` and, of more than one, their range: "1.07 (1.06-1.08)"."""
    if not values:
        return "n/a"
    median = f"{statistics.median(values):.{digits}f}{unit}"
    return median if len(values) == 1 else f"{median} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _fmt_slope(values: list) -> str:
    return _fmt_ratio(values, digits=1, unit=" s")


def _fmt_s(value: float | None) -> str:
    return "failed" if value is None else f"{value:.1f} s"


# --------------------------------------------------------------------------- tables


def sweep_tables(results, variants: dict, ns: list) -> list:
    keys = list(variants)
    extra = "a+" in variants
    head = ["jobs x ranks"] + [f"{variants[k].label} ({k})" for k in keys] + ["a/b", "a/c"]
    if extra:
        head += ["a+/a", "a+/b", "a+/c"]
    rows = []
    for n in ns:
        row = [f"{n} x 2"]
        for k in keys:
            row.append(_fmt_s(_median(r["wall"] for r in _ok(results, section="sweep", variant=k, n=n))))
        pairs = [("a", "b"), ("a", "c")] + ([("a+", "a"), ("a+", "b"), ("a+", "c")] if extra else [])
        for x, y in pairs:
            row.append(
                _fmt_ratio(
                    _paired_ratios(
                        results,
                        {"section": "sweep", "variant": x, "n": n},
                        {"section": "sweep", "variant": y, "n": n},
                    )
                )
            )
        rows.append(row)
    out = [
        (
            "**Sweep wall time** (N jobs x 2 ranks, tiny model, 4 steps a job; median wall time;"
            " ratios: median (range) of per-repeat ratios; < 1 means a is faster)"
        ),
        "",
    ]
    out += _table(head, rows)

    if len(ns) < 2:
        return out
    # growth with N: T(N)/T(N0), and the marginal seconds a job adds
    n0 = ns[0]
    head = ["variant"] + [f"T({n})/T({n0})" for n in ns[1:]]
    if len(ns) >= 2:
        head.append(f"s per extra job (N={ns[-2]}->{ns[-1]})")
    rows = []
    for k in keys:
        row = [f"{variants[k].label} ({k})"]
        for n in ns[1:]:
            row.append(
                _fmt_ratio(
                    _paired_ratios(
                        results,
                        {"section": "sweep", "variant": k, "n": n},
                        {"section": "sweep", "variant": k, "n": n0},
                    )
                )
            )
        if len(ns) >= 2:
            hi = _by_repeat(results, section="sweep", variant=k, n=ns[-1])
            lo = _by_repeat(results, section="sweep", variant=k, n=ns[-2])
            per_job = [
                (hi[r]["wall"] - lo[r]["wall"]) / (ns[-1] - ns[-2]) for r in sorted(hi.keys() & lo.keys())
            ]
            row.append(_fmt_slope(per_job))
        rows.append(row)
    out += [
        "",
        f"**Growth with N** (per-repeat ratios to N={n0}; the last column is the slope, in seconds)",
        "",
    ]
    out += _table(head, rows)
    return out


def stagger_table(results, stagger_n: int, stagger4_n: int) -> list:
    rows = []
    for num, den, n, ranks in (("a_d1", "a", stagger_n, 2), ("d4_1", "d4_0", stagger4_n, 4)):
        num_match = {"variant": num, "n": n}
        den_match = {"variant": den, "n": n, "section": "sweep" if den == "a" else "stagger"}
        ratios = _paired_ratios(results, dict(num_match, section="stagger"), den_match)
        hi, lo = _by_repeat(results, section="stagger", **num_match), _by_repeat(results, **den_match)
        per_job = [(hi[r]["wall"] - lo[r]["wall"]) / n for r in sorted(hi.keys() & lo.keys())]
        rows.append(
            [
                f"{n} x {ranks}",
                str(ranks - 1),
                f"{ranks - 2} x 1 s",
                _fmt_s(_median(r["wall"] for r in lo.values())),
                _fmt_s(_median(r["wall"] for r in hi.values())),
                _fmt_ratio(ratios),
                _fmt_slope(per_job),
            ]
        )
    head = [
        "jobs x ranks",
        "child spawns a job",
        "waits a job",
        "delay 0",
        "delay unset (1 s)",
        "unset/0",
        "extra s a job",
    ]
    out = [
        (
            f"**The stagger** (HydraDDP, `{DELAY_ENV}` unset = 1 s between child spawns, against 0;"
            " median wall time, per-repeat ratios)"
        ),
        "",
    ]
    return out + _table(head, rows)


def startup_table(results) -> list:
    floors = {}
    for key in FLOORS:
        ages: dict = {}
        for r in _ok(results, section="startup", variant=key):
            ages.setdefault(r["repeat"], []).append(r["age"])
        floors[key] = {rep: statistics.median(v) for rep, v in ages.items()}

    def child_ages(variant: str, event: str) -> dict:
        ages: dict = {}
        for r in _ok(results, section="sweep", variant=variant):
            ages.setdefault(r["repeat"], []).extend(
                rec["age"] for rec in r["records"] if rec["event"] == event and rec["local_rank"] >= 1
            )
        return {rep: statistics.median(v) for rep, v in ages.items() if v}

    rows_spec = [
        ('`python -c "import torch, pytorch_lightning"`: imports done (the floor)', floors["floor"]),
        ("`... import torch, pytorch_lightning, hydra_zen, hydra_fsdp`: imports done", floors["floor_hydra"]),
        ("HydraDDP child rank: launching script imported (`__mp_main__`)", child_ages("a", "app_loaded")),
        ("HydraDDP child rank: process group up (`LightningModule.setup`)", child_ages("a", "setup")),
        ("plain `ddp` child rank (re-runs the script): process group up", child_ages("c", "setup")),
        ("stock `ddp` lockstep child (re-runs the sweep): process group up, job 0", _first_job_ages(results)),
    ]
    rows = []
    for label, by_repeat in rows_spec:
        med = _median(by_repeat.values())
        row = [label, "n/a" if med is None else f"{med:.2f} s"]
        for floor in floors.values():
            common = sorted(by_repeat.keys() & floor.keys())
            row.append(_fmt_ratio([by_repeat[r] / floor[r] for r in common if floor[r]]))
        rows.append(row)
    out = [
        (
            "**Child-rank start-up** (seconds from the process's spawn, /proc/<pid>/stat starttime, to the"
            " event; median over ranks and repeats; ratios: per-repeat median / the floors measured in the"
            " same repeat, interleaved with the sweeps: `import torch, pytorch_lightning`, and the same plus"
            " `hydra_zen, hydra_fsdp`, which a HydraDDP child must import too)"
        ),
        "",
    ]
    return out + _table(["process, event", "spawn to event", "/ floor", "/ floor with hydra"], rows)


def server_memory_table(results, ns: list) -> list:
    """The fork server's peak memory while a HydraDDP sweep ran, beside its ranks' own."""

    def mib(values: list) -> str:
        values = [v for v in values if v]
        return "n/a" if not values else f"{statistics.median(values) / 1024:.0f} MiB"

    rows = []
    for n in ns:
        runs = _ok(results, section="sweep", variant="a", n=n)
        ends = [rec for r in runs for rec in r["records"] if rec["event"] == "fit_end"]
        rows.append(
            [
                f"{n} x 2",
                mib([r["server_peak_kib"].get("server_rss") for r in runs]),
                mib([r["server_peak_kib"].get("server_pss") for r in runs]),
                mib([rec["vm_hwm"] for rec in ends if rec["local_rank"] >= 1]),
                mib([rec["vm_hwm"] for rec in ends if rec["local_rank"] == 0]),
            ]
        )
    out = [
        (
            "**The fork server's memory** while the HydraDDP sweep runs (sampled every"
            f" {SAMPLE_EVERY} s; median of the runs' peaks). RSS counts the pages it shares with the"
            " children it forked; PSS splits each shared page among its sharers, so the server's PSS is"
            " what it adds."
        ),
        "",
    ]
    header = [
        "jobs x ranks",
        "fork server, peak RSS",
        "fork server, peak PSS",
        "a child rank, peak RSS",
        "rank 0, peak RSS",
    ]
    return out + _table(header, rows)


def _first_job_ages(results) -> dict:
    ages: dict = {}
    for r in _ok(results, section="sweep", variant="b"):
        ages.setdefault(r["repeat"], []).extend(
            rec["age"]
            for rec in r["records"]
            if rec["event"] == "setup" and rec["local_rank"] >= 1 and rec["job"] == 0
        )
    return {rep: statistics.median(v) for rep, v in ages.items() if v}


def _memory_stats(results, key: str, depth: int) -> dict:
    """Per repeat: the larger of the two ranks' figures, from one single-job run."""
    per_repeat = {}
    for r in _ok(results, section="memory", variant=key):
        if r["model"]["depth"] != depth:
            continue
        baseline = {rec["pid"]: rec["vm_rss"] for rec in r["records"] if rec["event"] == "init"}
        ends = [rec for rec in r["records"] if rec["event"] == "fit_end"]
        per_repeat[r["repeat"]] = {
            "wall": r["wall"],
            "params_total": ends[0]["params_total"],
            "params_held": max(rec["params_held"] for rec in ends),
            "peak": max(rec["vm_hwm"] for rec in ends),
            "above": max(rec["vm_hwm"] - baseline[rec["pid"]] for rec in ends),
            "ru_over_hwm": max(rec["ru_maxrss"] / rec["vm_hwm"] for rec in ends),
            "per_rank": {
                rec["global_rank"]: [rec["params_held"], rec["vm_hwm"], rec["ru_maxrss"]] for rec in ends
            },
        }
    return per_repeat


def memory_rows(results, depths: list) -> tuple:
    rows, notes = [], []
    for depth in depths:
        for suffix, allocator in ALLOCATORS.items():
            ddp, fsdp = (
                _memory_stats(results, "ddp" + suffix, depth),
                _memory_stats(results, "fsdp" + suffix, depth),
            )
            common = sorted(ddp.keys() & fsdp.keys())
            if not common:
                rows.append([f"{depth} x Linear({MEM_WIDTH})", allocator] + ["failed"] * 7)
                continue
            total = ddp[common[0]]["params_total"]
            med = {
                name: {
                    field: statistics.median(x[field] for x in stats.values())
                    for field in ("params_held", "peak", "above")
                }
                for name, stats in (("ddp", ddp), ("fsdp", fsdp))
            }
            ratio = {
                field: _fmt_ratio([fsdp[r][field] / ddp[r][field] for r in common])
                for field in ("params_held", "peak", "above", "wall")
            }
            rows.append(
                [
                    f"{total / 1e6:.1f}M ({depth} x Linear({MEM_WIDTH}))",
                    allocator,
                    f"{med['ddp']['params_held'] / 1e6:.1f}M / {med['fsdp']['params_held'] / 1e6:.1f}M",
                    ratio["params_held"],
                    f"{med['ddp']['peak'] / 1024:.0f} / {med['fsdp']['peak'] / 1024:.0f}",
                    ratio["peak"],
                    f"{med['ddp']['above'] * 1024 / total:.1f} / {med['fsdp']['above'] * 1024 / total:.1f}",
                    ratio["above"],
                    ratio["wall"],
                ]
            )
            worst = max(x["ru_over_hwm"] for x in list(ddp.values()) + list(fsdp.values()))
            notes.append(
                (
                    depth,
                    allocator,
                    worst,
                    {"ddp": ddp[common[0]]["per_rank"], "fsdp": fsdp[common[0]]["per_rank"]},
                )
            )
    head = [
        "model (params)",
        "allocator",
        "params/rank DDP / FSDP",
        "FSDP/DDP",
        "peak RSS/rank MiB DDP / FSDP",
        "FSDP/DDP",
        "peak above baseline, bytes/param DDP / FSDP",
        "FSDP/DDP",
        "wall FSDP/DDP",
    ]
    out = [
        (
            f"**HydraFSDP vs HydraDDP, 2 ranks, Adam** (CPU/gloo, one job, {MEM_STEPS} steps of batch"
            f" {MEM_BATCH}; FSDP auto-wrapped per Linear; per rank = the larger of the 2 ranks; peak = VmHWM"
            " at the end of fit; baseline = the rank's RSS before its model was built; ratios: median (range)"
            " of per-repeat ratios)"
        ),
        "",
    ]
    return out + _table(head, rows), notes


def _table(head: list, rows: list) -> list:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


# --------------------------------------------------------------------------- header


def header(args, started: float, load_start: tuple, elapsed: float) -> list:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    cpu = _proc_field("/proc/cpuinfo", "model name", ":") or "unknown CPU"
    mem_kib = _proc_field("/proc/meminfo", "MemTotal", ":")
    mem = f"{int(mem_kib.split()[0]) / 2**20:.1f} GiB" if mem_kib else "? GiB"
    commit = _git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = _git("status", "--porcelain", "--", "hydra_fsdp.py")
    load_end = os.getloadavg()
    command = " ".join(["python bench/run.py", *sys.argv[1:]])
    return [
        (
            f"- **Machine**: {cpu}, {os.cpu_count()} CPUs, {mem}, {platform.system()} {platform.release()};"
            f" load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end"
            " (other work was running: figures are ratios for that reason)"
        ),
        (
            f"- **Libraries**: Python {platform.python_version()}, torch {version('torch')},"
            f" pytorch-lightning {version('pytorch-lightning')}, hydra-core {version('hydra-core')},"
            f" hydra-zen {version('hydra-zen')}; hydra_fsdp.py at {commit}"
            f"{' with local changes' if dirty else ''}"
        ),
        (
            f"- **Run**: `{command}`, {args.repeats} repeat(s)"
            f"{f' ({args.memory_repeats} for memory)' if 'memory' in args.sections else ''},"
            f" {elapsed / 60:.1f} min, started {datetime.datetime.fromtimestamp(started):%Y-%m-%d %H:%M};"
            f" sweep model: {TINY['depth']} x Linear({TINY['width']}), {TINY['steps']} steps of batch"
            f" {TINY['batch']} a job; CPU, gloo"
        ),
    ]


def _proc_field(path: str, key: str, sep: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(sep, 1)[1].strip()
    except OSError:
        pass
    return ""


def _git(*args) -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30, check=False
        )
        return proc.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="N=1,4, 1 repeat, a 12M model, the 4-rank stagger at N=1: a few minutes",
    )
    parser.add_argument(
        "--ns", type=lambda s: [int(x) for x in s.split(",")], help="jobs per sweep (default 1,4,16)"
    )
    parser.add_argument("--repeats", type=int, help="repeats of the sweep section (default 3; --quick 1)")
    parser.add_argument(
        "--memory-repeats", type=int, help="repeats of the memory section (default 2; --quick 1)"
    )
    parser.add_argument(
        "--depths",
        type=lambda s: [int(x) for x in s.split(",")],
        help=f"memory models, in Linear({MEM_WIDTH}) layers (default 3,12,24 = 12.6M,50.4M,100.7M)",
    )
    parser.add_argument(
        "--sections", default="sweep,stagger,memory", help="any of sweep (with start-up), stagger, memory"
    )
    parser.add_argument(
        "--hydra-ddp-extra",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="add variant a+ = HydraDDP (a) with this Hydra override too (repeatable)",
    )
    parser.add_argument(
        "--hydra-ddp-extra-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="add variant a+ = HydraDDP (a) with this environment variable too (repeatable)",
    )
    parser.add_argument("--hydra-ddp-extra-label", default="HydraDDP + extra", help="the name of variant a+")
    parser.add_argument(
        "--only", type=lambda s: s.split(","), help="the sweep variants to run (e.g. a,a+; default: all)"
    )
    parser.add_argument("--workdir", help="where the runs go (default: a new temporary directory)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run directories (logs, sweeps, records)"
    )
    parser.add_argument("--json", help="also write every measurement to this JSON file")
    args = parser.parse_args(argv)
    if args.ns is None:
        args.ns = [1, 4] if args.quick else [1, 4, 16]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.memory_repeats is None:
        args.memory_repeats = 1 if args.quick else 2
    if args.depths is None:
        args.depths = [3] if args.quick else [3, 12, 24]
    args.sections = set(args.sections.split(","))
    # the 2-rank stagger is paired with (a) at this N; the 4-rank one runs at stagger4_n
    args.stagger_n = 4 if 4 in args.ns else args.ns[-1]
    args.stagger4_n = 1 if args.quick else args.stagger_n
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started, t0, load_start = time.time(), time.perf_counter(), os.getloadavg()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hydra_fsdp_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    _progress(f"runs go to {workdir}")
    runner = Runner(workdir)
    variants = sweep_variants(args)
    stagger = stagger_variants()
    memory = memory_variants()

    for repeat in range(args.repeats):
        if "sweep" in args.sections:
            for n in args.ns if repeat % 2 == 0 else list(reversed(args.ns)):
                block = list(variants) + ["floor", "floor_hydra"]
                block = block[:2] + ["floor_hydra", "floor"] + block[2:]  # 2 of each floor a block
                if "stagger" in args.sections and n == args.stagger_n:
                    block.append("a_d1")
                for key in _rotated(block, repeat):
                    if key in FLOORS:
                        runner.floor(key, repeat)
                    elif key in variants:
                        runner.run(variants[key], n, repeat, "sweep")
                    else:
                        runner.run(stagger[key], n, repeat, "stagger")
        if "stagger" in args.sections:
            for key in _rotated(["d4_0", "d4_1"], repeat):
                runner.run(stagger[key], args.stagger4_n, repeat, "stagger")
    if "memory" in args.sections:
        for repeat in range(args.memory_repeats):
            for depth in args.depths:
                model = {"width": MEM_WIDTH, "depth": depth, "batch": MEM_BATCH, "steps": MEM_STEPS}
                for key in _rotated(list(memory), repeat + depth):
                    runner.run(memory[key], 1, repeat, "memory", model=model)

    elapsed = time.perf_counter() - t0
    results = runner.results
    out = ["### Benchmarks", ""] + header(args, started, load_start, elapsed) + [""]
    if "sweep" in args.sections:
        out += sweep_tables(results, variants, args.ns) + [""]
        out += startup_table(results) + [""]
        out += server_memory_table(results, args.ns) + [""]
    if "stagger" in args.sections and "sweep" in args.sections:
        out += stagger_table(results, args.stagger_n, args.stagger4_n) + [""]
    if "memory" in args.sections:
        table, notes = memory_rows(results, args.depths)
        out += table + [""]
        for depth, allocator, worst, per_rank in notes:
            if worst > 1.1:
                out.append(
                    f"- depth {depth}, {allocator}: `ru_maxrss` exceeds VmHWM by up to {worst:.2f}x on a rank"
                    " (Linux carries the spawning parent's peak over a vfork+exec into the child's"
                    " ru_maxrss); per rank (params held, VmHWM KiB, ru_maxrss KiB):"
                    f" {json.dumps(per_rank)}"
                )
        out.append("")
    for title, items in (
        ("**Runs that finished but exited non-zero** (their times count)", runner.exit_notes),
        ("**Failures** (left out of the tables)", runner.failures),
    ):
        if items:
            out += [title, ""]
        for failure in items:
            out += [
                f"- {failure['what']}: {failure['error']} (log: {failure['log']})",
                "",
                "```",
                failure["tail"],
                "```",
                "",
            ]
    print("\n".join(out))

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    if args.keep or runner.failures:
        _progress(f"kept {workdir}" + (" (there were failures)" if runner.failures and not args.keep else ""))
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
