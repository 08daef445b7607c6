"""What the bench apps measure inside each rank: process age, memory, and JSON-lines records.

Standard library only, so that importing it costs nothing measurable. Every process appends its
records to ``$BENCH_RECORD_DIR/<pid>.jsonl``; without ``BENCH_RECORD_DIR`` nothing is written.
"""

import json
import os
import resource
import time


def process_age() -> float:
    """Seconds since this process was forked (its spawn), to the kernel's clock tick (10 ms).

    ``starttime`` in ``/proc/self/stat`` counts clock ticks since boot on CLOCK_BOOTTIME, so
    comparing it with that clock needs no ``btime`` (which ``/proc/stat`` rounds to a whole second).
    """
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (comm)": fields 3..
    started = int(fields[22 - 3]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


def memory_kib() -> dict:
    """Resident memory now and at its peak, in KiB.

    ``vm_hwm`` is this process image's own peak. ``ru_maxrss`` also counts, for a process that a
    big parent started with vfork/posix_spawn (as subprocess.Popen does), the parent's peak at
    the time: Linux carries it over exec. Both are recorded; the tables use ``vm_hwm``.
    """
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0])
    return {
        "vm_rss": status.get("VmRSS"),
        "vm_hwm": status.get("VmHWM"),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def record(event: str, **fields) -> None:
    directory = os.environ.get("BENCH_RECORD_DIR")
    if not directory:
        return
    entry = {
        "event": event,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "time": time.time(),
        "age": process_age(),
        **fields,
    }
    with open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a") as out:
        out.write(json.dumps(entry) + "\n")


def read_records(directory: str) -> list:
    entries = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                entries.extend(json.loads(line) for line in f if line.strip())
    return entries
