"""Hydra 1.4's execution whitelist, swept with HydraDDP: ``@hydra.main(execution_whitelist=["os.chdir"])``
allows a target that Hydra refuses by default (``os.chdir`` is on its blacklist) and refuses every
target it does not list (``collections.OrderedDict``). Every rank instantiates both and writes what the
policy did to ``<job dir>/policy/rank<N>.json``, then trains: a child rank under another policy than
rank 0's would allow or refuse otherwise (before hydra_fsdp ran children under rank 0's policy, rank 1
refused ``os.chdir`` and allowed ``OrderedDict``)."""

import json
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from typed_app import fit

PROBES = {
    "allowed": {"_target_": "os.chdir", "path": "."},
    "refused": {"_target_": "collections.OrderedDict"},
}


def outcome(probe):
    try:
        instantiate(probe)
        return "allowed"
    except Exception as error:  # noqa: BLE001 - Hydra's refusal, recorded by its type
        return type(error).__name__


def train(cfg):
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    seen = Path(HydraConfig.get().runtime.output_dir, "policy")
    seen.mkdir(exist_ok=True)
    record = {name: outcome(cfg.probes[name]) for name in PROBES}
    (seen / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "lr": cfg.lr, **record}))
    fit(2, [], 1, cfg.lr)  # typed_app's: HydraDDP on 2 CPU ranks
    return record


if __name__ == "__main__":
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config", node={"lr": 0.1, "probes": PROBES})
    hydra.main(config_path=None, config_name="config", version_base="1.3", execution_whitelist=["os.chdir"])(
        train
    )()
