"""A hung rank (failure mode 8).

Rank 1 stops in its data loader before step 3's collectives. Rank 0 must
fail within ``parallel.timeout_s`` (plus the few seconds the report takes)
with an error naming rank 1, and ``run.dir/hang-<rank>.txt`` must hold each
rank's Python stack, the last collective phase it entered and its newest
collectives from torch's flight recorder: rank 1's shows it blocked in the
loader, after step 2's optimizer step, one collective behind rank 0.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from giantmodel.testing import run_ranks

TIMEOUT_S = 4.0
STALL_S = 14.0
TINY = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=256",
        "model.max_seq_len=64", "train.seq_len=32", "train.global_batch_size=8",
        "train.micro_batch_size=4", "data.source=synthetic", "train.log_every=1",
        "train.sample_tokens=0", "train.eval_every=0", "run.tensorboard=false",
        "run.progress=false", "parallel.dp=2", f"parallel.timeout_s={TIMEOUT_S}",
        "checkpoint.every=1000", "checkpoint.save_final=false", "train.steps=5",
        "train.threads=1"]


class _StallingLoader:
    """The real loader, except that it blocks before step ``at``'s batch."""

    def __init__(self, loader, trainer, at: int):
        self.loader, self.trainer, self.at, self.stalled = loader, trainer, at, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.trainer.state.step + 1 == self.at and not self.stalled:
            self.stalled = True
            time.sleep(STALL_S)  # a deadlocked loader / stuck file system read
        return next(self.loader)


def _worker(rank: int, world: int, run_dir: str) -> dict:
    from giantmodel.config import load_config
    from giantmodel.config.errors import RunStopped
    from giantmodel.train.trainer import Trainer

    t = Trainer(load_config(None, [*TINY, f"run.dir={run_dir}"]))
    if rank == 1:
        t.train_loader = _StallingLoader(t.train_loader, t, at=3)
    start = time.monotonic()
    try:
        t.train()
        outcome = "finished"
    except RunStopped as e:
        outcome = f"stopped: {e}"
    except Exception as e:  # noqa: BLE001 - rank 1 fails once rank 0 has left
        outcome = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    t.hang.close()
    return {"outcome": outcome, "elapsed": elapsed}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", "auto"])
def test_hung_rank_is_named_and_every_rank_writes_its_stack(tmp_path, backend):
    """gloo: a process group made before the trainer, recorded by torch's
    flight recorder. auto: the trainer makes it (the giant backend on CPU),
    and the giant backend's own record shows its collectives."""
    run = tmp_path / "run"
    r0, _ = run_ranks(_worker, 2, str(run), timeout=90,
                      backend="gloo" if backend == "gloo" else None, pg_timeout=60)
    msg = r0["outcome"]
    assert msg.startswith("stopped: rank 1 did not arrive at step 3 forward_backward"), msg
    assert "rank 1 last entered step 2 optimizer_step" in msg, msg
    assert "hang-<rank>.txt" in msg
    # the stall starts after step 2; rank 0 gives up within its timeout + the report
    assert r0["elapsed"] < STALL_S, r0

    hang0, hang1 = (Path(run) / f"hang-{r}.txt" for r in (0, 1))
    text0, text1 = hang0.read_text(), hang1.read_text()
    assert text0.startswith("rank 0 of 2") and text1.startswith("rank 1 of 2")
    assert "last collective phase entered: step 3 forward_backward" in text0, text0
    assert "last collective phase entered: step 2 optimizer_step" in text1, text1
    # rank 1's main thread is shown blocked in the loader, inside its step;
    # rank 0 wrote its own while reporting, from the training loop
    assert "in __next__" in text1 and "in train_step" in text1, text1
    assert "in report" in text0 and "in train" in text0, text0
    # the flight recorder shows the collective rank 0 waits in, which rank 1
    # never entered: the same group, one sequence number further
    newest = [_newest_collective(t) for t in (text0, text1)]
    desc = "default_pg" if backend == "gloo" else "giant"
    assert newest[0][0] == newest[1][0] == f"0 ({desc}, ranks [0, 1])", newest
    assert newest[0][1] == newest[1][1] + 1, newest
    assert (f"newest collective entered: rank 0 group 0 ({desc}, ranks [0, 1]) "
            f"#{newest[0][1]}") in msg, msg
    assert f"rank 1 group 0 ({desc}, ranks [0, 1]) #{newest[1][1]}" in msg, msg


def _newest_collective(text: str) -> tuple[str, int]:
    """(group, sequence number) of the first line under the flight-recorder heading."""
    block = text.split("last collectives entered (", 1)[1].splitlines()[1]
    m = re.match(r"\s+group (.+\]\)) #(\d+) (gloo|giant):", block)
    assert m, block
    return m.group(1), int(m.group(2))
