"""Drive giantmodel from Python: load a config, train, sample, and evaluate.

    python examples/train_api.py train.steps=50
"""

import sys

from giantmodel.config import load_config
from giantmodel.train import Trainer

cfg = load_config("configs/gpt/tiny.yaml", ["run.dir=runs/api-example", *sys.argv[1:]])
trainer = Trainer(cfg)
try:
    summary = trainer.train()
    print(f"first loss {summary['first_loss']:.3f} -> val loss {summary['val_loss']:.3f}")
    print(trainer.sample("import ", max_new_tokens=64))
finally:
    trainer.close()
