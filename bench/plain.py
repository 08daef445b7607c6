"""The no-Hydra baseline: one plain script, Lightning's Trainer(strategy="ddp"), one run per call.

    python bench/plain.py --devices 2 --trial 0

Lightning starts rank 1 by re-running this script. The LightningModule is model.Bench, as in
app.py (which this script does not import: it would pay for Hydra and hydra_zen). Records go to
$BENCH_RECORD_DIR like the app's.
"""

import argparse

import pytorch_lightning as pl
from model import Bench
from probe import record

record("app_loaded", module=__name__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trial", type=int, default=0)
    args = parser.parse_args()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = Bench(width=args.width, depth=args.depth, batch=args.batch, steps=args.steps, trial=args.trial)
    trainer.fit(module)


if __name__ == "__main__":
    main()
