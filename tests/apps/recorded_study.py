"""An Optuna storage that writes its study to a JSON file whenever a trial's state changes, for
``hydra.sweeper.storage={_target_:recorded_study.RecordedStorage,path:<file>}``: what the Optuna
sweeper told its study, readable by the tests after the sweep, even one that ended by raising.

Why not a sqlite storage: hydra-optuna-sweeper 1.3 needs optuna < 3, and optuna 2.10's RDBStorage
fails on the SQLAlchemy 2 that pip installs beside it (an AssertionError in get_current_version as
it creates the database). SQLAlchemy 1.4 needs an alembic older than pip's (1.20 requires SQLAlchemy
2; 1.13.3 works): two pins in the test extras for everyone, for what this file does without them.
"""

import json
from pathlib import Path

from optuna.storages import InMemoryStorage


class RecordedStorage(InMemoryStorage):
    def __init__(self, path):
        super().__init__()
        self.path = Path(path)

    def set_trial_state(self, trial_id, state):
        changed = super().set_trial_state(trial_id, state)
        # Study.tell sets a trial's values before its state: they are in the study by now
        trials = self.get_all_trials(self.get_study_id_from_trial_id(trial_id), deepcopy=False)
        study = [
            {"number": t.number, "state": t.state.name, "values": t.values, "params": t.params}
            for t in trials
        ]
        writing = self.path.with_suffix(".part")  # whole or not at all: renamed into place
        writing.write_text(json.dumps(study))
        writing.replace(self.path)
        return changed
