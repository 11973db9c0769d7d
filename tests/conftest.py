"""Suite-wide settings: one intra-op thread.

The suite's models are tiny; on a 2-core host, thread hand-off costs more
than it gains, and spawned ranks already run one thread each."""

import torch

torch.set_num_threads(1)
