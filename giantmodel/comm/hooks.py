"""DDP communication hook that gives the first layers' buckets priority.

DDP fills buckets in reverse layer order during backward, so bucket 0 holds
the last layers and the highest index the first ones. The next forward needs
the first layers first; with ``comm.priority`` on, the giant engine runs a
queued higher-priority all-reduce before lower ones. Register with::

    ddp.register_comm_hook(state=group, hook=priority_allreduce_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations
# against the real classes.

import torch
import torch.distributed as dist

from giantmodel.comm.backend import GiantProcessGroup


def priority_allreduce_hook(group, bucket: dist.GradBucket
                            ) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients with priority = bucket index."""

    buf = bucket.buffer()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    if isinstance(group, GiantProcessGroup):
        work = group.allreduce([buf], opts, priority=bucket.index())
    else:  # any other group: plain sum, divided after, like DDP's default hook
        buf.div_(group.size())
        work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
