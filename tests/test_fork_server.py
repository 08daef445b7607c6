"""Every job gets fresh child processes, forked by one fork server per sweep (see _ForkServer).

What a fresh process has of its own must hold: a new pid per rank per job, module state at its
initial value, the job's environment in force (``hydra.job.env_set``, ``OMP_NUM_THREADS`` too),
its own random numbers, Lightning's rank; and the server must end with the sweep, however it ends.
"""

import json
import signal

from helpers import SWEEP_TIMEOUT, alive, ok, records, start_sweep, started_pids, sweep_in, wait_for

PER_JOB_ENV = (
    "+hydra.job.env_set.JOB_TAG=job_${hydra:job.num}",
    "+hydra.job.env_set.OMP_NUM_THREADS='${plus:${hydra:job.num},1}'",
)


def test_every_job_gets_fresh_child_processes(app):
    proc = ok(sweep_in(app, "module.lr=0.1,0.2,0.3", *PER_JOB_ENV))
    rank0 = [records(app / "sweep" / str(job))[0] for job in range(3)]
    child = [records(app / "sweep" / str(job))[1] for job in range(3)]
    assert len({c["pid"] for c in child}) == 3, "a new process for every job"
    servers = {c["ppid"] for c in child}
    assert len(servers) == 1 and servers != {rank0[0]["pid"]}, "forked by one fork server, not by rank 0"
    assert [c["jobs_run_here"] for c in child] == [1, 1, 1], "module state starts afresh in every job"
    assert [r["jobs_run_here"] for r in rank0] == [1, 2, 3]  # rank 0 is the sweep's own process
    assert [c["job_tag"] for c in child] == ["job_0", "job_1", "job_2"]
    assert [c["threads"] for c in child] == [1, 2, 3], "the job's OMP_NUM_THREADS in force"
    assert len({c["numpy_draw"] for c in child}) == 3, "its own random numbers"
    assert [c["rank_zero_only_rank"] for c in child] == [1, 1, 1] and rank0[0]["rank_zero_only_rank"] == 0
    for job in range(3):
        assert records(app / "sweep" / str(job))[0]["weight_sum"] == child[job]["weight_sum"]
    wait_for(lambda: not alive(servers.pop()), 10, "the fork server to end with the sweep")
    print(f"3 jobs x 2 ranks, fresh children: {proc.seconds:.1f} s")


def test_sigkill_of_the_sweep_leaves_no_server_and_no_child(app):
    sweep = start_sweep(app, "module.lr=0.1,0.2", env={"APP_SLOW_STEPS": "1"})
    job = app / "sweep" / "0"
    try:
        wait_for(lambda: len(started_pids(job)) == 2, SWEEP_TIMEOUT, "both ranks of job 0 to start")
        child = json.loads((job / "started" / "rank1.json").read_text())
        sweep.proc.send_signal(signal.SIGKILL)
        sweep.proc.wait(timeout=10)
    finally:
        sweep.end()
    for what, pid in (("fork server", child["ppid"]), ("child rank", child["pid"])):
        wait_for(
            lambda pid=pid: not alive(pid), 10, f"the {what} (pid {pid}) to end after the sweep was killed"
        )
