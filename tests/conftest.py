"""Suite-wide settings: one intra-op thread, and tests that time the host first.

The suite's models are tiny; on a 2-core host, thread hand-off costs more
than it gains, and spawned ranks already run one thread each.

A test marked ``quiet_host`` times this host and needs it idle: it runs
before every other test, while the load the suite itself makes (the
1-minute load average stays near 2 while it runs) has not yet built up, so
it seldom has to wait for the load to fall."""

import os

import torch

torch.set_num_threads(1)
# Ranks fork from one server that imported torch and giantmodel once
# (giantmodel/testing/ranks.py): 3-5 s less per rank on a 2-core host.
os.environ.setdefault("GIANTMODEL_RANKS_START", "forkserver")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("quiet_host") is None)
