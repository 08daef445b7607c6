"""The command ``_rank_launch`` builds for each child rank, and the unit tests pin, is one that runs:
``python hydra_fsdp.py <launch file>`` with that environment joins the job as a forked child does."""

import shutil
import sys
from pathlib import Path

from helpers import APPS, app_env, assert_ranks_agree, copy_app, ok, records, run

ROOT = Path(__file__).resolve().parent.parent


def test_the_child_rank_command_run_as_a_new_process_joins_its_job(tmp_path):
    app = copy_app(tmp_path / "app")
    shutil.copy(APPS / "by_hand.py", app / "by_hand.py")
    command = [sys.executable, "by_hand.py", "-m", "hydra.sweep.dir=sweep", "module.lr=0.1,0.2"]
    ok(run(command, app, app_env()))
    for job in ("0", "1"):
        job_dir = app / "sweep" / job
        started = (job_dir / "by_hand").read_text().split("\n")[0].split()
        pid, script, launch_file = int(started[0]), started[2], started[3]
        assert (script, launch_file) == (str(ROOT / "hydra_fsdp.py"), str(job_dir / "rank_config.pickle"))
        seen = assert_ranks_agree(job_dir)
        assert seen[1]["pid"] == pid, "rank 1 is the process started by the command"
        assert seen[1]["ppid"] == seen[0]["pid"], "rank 1 was started by rank 0, not forked by the server"
        assert seen[1]["lr"] == (0.1, 0.2)[int(job)]
        assert records(job_dir, "fit")[1]["jobs_run_here"] == 1
