"""A real SLURM cluster on this one host, for tests: munged, slurmctld and slurmd in a scratch dir.

    cluster = start_cluster(tmp_dir)      # raises SlurmNotInstalled if a binary is missing
    subprocess.run(["sbatch", ...], env=dict(os.environ, **cluster.env))
    cluster.stop()                        # cancels its jobs, then ends the daemons it started

Nothing is installed or changed outside ``tmp_dir`` and one short-named munge directory in the
system temp dir (the munge socket's path must be short and world-traversable). The daemons run
as the current user (root in CI, as ``SlurmUser``), with no cgroups and no accounting database,
on free ports, so two clusters on one host do not collide.

Without an accounting database the real ``sacct`` fails ("Slurm accounting storage is
disabled"), yet submitit polls it to learn a job's state. ``cluster.env`` puts a stand-in first on
PATH that answers submitit's query (``sacct -o JobID,State,NodeList --parsable2 -j ID ...``) from
``scontrol show job``; ``MinJobAge`` keeps finished jobs visible there for 5 minutes.
"""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
PARTITION = "debug"
START_TIMEOUT = 60  # seconds for the node to come up idle
JOB_END_GRACE = 10  # seconds a job may take to end on its own before stop() cancels it
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
INSTALL_HINT = "apt-get install -y slurm-wlm munge"


class SlurmUnavailable(RuntimeError):
    """The cluster would not start: the message holds the daemons' logs."""


class SlurmNotInstalled(SlurmUnavailable):
    """A SLURM or munge binary is missing here: the message names them."""


def which(name):
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def missing_binaries():
    return [name for name in DAEMONS + CLIENTS if which(name) is None]


SACCT_STAND_IN = '''\
#!{python}
"""sacct for a cluster without an accounting database: job states from `scontrol show job`.

Answers what submitit asks: sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]
"""
import re, subprocess, sys

args = sys.argv[1:]
fields, ids = ["JobID", "State", "NodeList"], []
for i, arg in enumerate(args):
    if arg in ("-o", "--format"):
        fields = args[i + 1].split(",")
    elif arg.startswith("--format="):
        fields = arg.split("=", 1)[1].split(",")
    elif arg in ("-j", "--jobs"):
        ids += args[i + 1].split(",")

def value(line, key):
    found = re.search(r"(?:^|\\s)" + key + r"=(\\S*)", line)
    return found.group(1) if found else ""

rows = []
for job_id in ids:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    for line in shown.stdout.splitlines():
        if not value(line, "JobId"):
            continue
        task = value(line, "ArrayTaskId")
        if task:  # one task of an array, or the still-pending rest of it: 5_1 or 5_[0-3]
            task = task if task.isdigit() else "[" + task.split("%")[0] + "]"
            jobid = value(line, "ArrayJobId") + "_" + task
        else:
            jobid = value(line, "JobId")
        nodes = value(line, "NodeList")
        row = {{"JobID": jobid, "State": value(line, "JobState"),
               "NodeList": "None assigned" if nodes in ("", "(null)") else nodes}}
        rows.append("|".join(row.get(field, "") for field in fields))
print("|".join(fields))
print("\\n".join(rows))
'''


class Cluster:
    """A running single-host cluster. ``env``: what a client adds to its environment."""

    def __init__(self, root, conf, munge_dir, env, partition=PARTITION):
        self.root = root
        self.conf = conf
        self.munge_dir = munge_dir
        self.env = env
        self.partition = partition
        self.procs = {}  # daemon name -> Popen, in start order

    def client_env(self):
        return dict(os.environ, **self.env)

    def run(self, *command, check=True, timeout=30):
        return subprocess.run(
            command, env=self.client_env(), capture_output=True, text=True, check=check, timeout=timeout
        )

    def logs(self, lines=30):
        """The tail of every daemon's log: what to print when something went wrong."""
        out = []
        for log in sorted(self.root.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def jobs_left(self):
        """Ids of this cluster's jobs that have not ended (pending, running, completing)."""
        queued = self.run("squeue", "-h", "-o", "%i %T", check=False, timeout=15)
        return [line.split()[0] for line in queued.stdout.splitlines() if line.split()[1] in LIVE_STATES]

    def stop(self):
        """End the daemons this cluster started, by PID (TERM, then KILL), and their jobs first.

        A job that is just finishing is given a few seconds; any other is cancelled.
        """
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                for grace, cancel in ((JOB_END_GRACE, False), (30, True)):
                    if cancel and self.jobs_left():
                        self.run("scancel", "--full", *self.jobs_left(), check=False, timeout=15)
                    deadline = time.monotonic() + grace
                    while self.jobs_left() and time.monotonic() < deadline:
                        time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
        self.procs.clear()
        shutil.rmtree(self.munge_dir, ignore_errors=True)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_conf(root, host, munge_socket, cpus):
    return f"""\
ClusterName=pytest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={getpass.getuser()}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# finished jobs stay visible to `scontrol show job` (and so to the sacct stand-in) for 5 minutes
MinJobAge=300
KillWait=5
# job ids (and so Lightning's SLURM port, 15000 + the id's last 4 digits) differ between clusters
FirstJobId={1000 + int.from_bytes(os.urandom(2), "big") % 8000}
# a node with fewer real CPUs than configured stays usable (2 tasks on a 1-core machine)
SlurmdParameters=config_overrides
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _wait(predicate, timeout, what, cluster):
    deadline = time.monotonic() + timeout
    while not predicate():
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited ({proc.returncode}) while {what}\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"timed out after {timeout} s {what}\n{cluster.logs()}")
        time.sleep(0.2)


def start_cluster(tmp_dir, cpus=None):
    """Start munged, slurmctld and slurmd under ``tmp_dir``; return the running Cluster.

    Raises SlurmNotInstalled naming what is missing, or SlurmUnavailable with the daemons' logs.
    """
    missing = missing_binaries()
    if missing:
        raise SlurmNotInstalled(f"SLURM is not installed here: no {', '.join(missing)} ({INSTALL_HINT})")
    root = Path(tmp_dir).resolve()
    for sub in ("state", "spool", "bin"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # munged wants every directory above its socket traversable by all, and the path short
    munge_dir = Path(tempfile.mkdtemp(prefix="munge-"))
    munge_dir.chmod(0o755)
    munge_socket = munge_dir / "socket"
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, host, munge_socket, max(2, cpus or os.cpu_count() or 1)))
    sacct = root / "bin" / "sacct"
    sacct.write_text(SACCT_STAND_IN.format(python=sys.executable))
    sacct.chmod(0o755)
    env = {"SLURM_CONF": str(conf), "PATH": os.pathsep.join([str(root / "bin"), os.environ.get("PATH", "")])}
    cluster = Cluster(root, conf, munge_dir, env)

    def daemon(name, *args):
        with open(root / f"{name}.out", "wb") as out:
            cluster.procs[name] = subprocess.Popen(
                [which(name), *args],
                env=cluster.client_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the tests reaches the tests, and stop() ends these
            )

    try:
        key = root / "munge.key"
        subprocess.run([which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o400)
        daemon(
            "munged", "--foreground", f"--key-file={key}", f"--socket={munge_socket}",
            f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
            f"--seed-file={root / 'munged.seed'}",
        )  # fmt: skip
        _wait(munge_socket.exists, START_TIMEOUT, "waiting for munged's socket", cluster)
        daemon("slurmctld", "-D", "-c", "-i", "-f", str(conf))
        _wait(lambda: "is UP" in cluster.run("scontrol", "ping", check=False).stdout, START_TIMEOUT,
              "waiting for slurmctld to answer", cluster)  # fmt: skip
        daemon("slurmd", "-D", "-N", host, "-f", str(conf))

        def node_idle():
            state = cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False)
            return state.returncode == 0 and state.stdout.strip() == "idle"

        _wait(node_idle, START_TIMEOUT, "waiting for the node to be idle in sinfo", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster
