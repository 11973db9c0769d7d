"""Planner: predict memory and speed of a layout before launch, and pick one.

* :mod:`hardware` - accelerator profiles (built-in and user YAML);
* :mod:`memory` - per-rank memory: model states, activations, buffers;
* :mod:`perf` - step time, tokens/s, TFLOP/s, MFU, bubble and comm shares;
* :mod:`search` - layout search with the least recompute that fits;
* :mod:`report` - JSON/table output and the pipeline imbalance report;
* :mod:`commands` - ``giantmodel estimate`` / ``giantmodel plan``;
* :mod:`hwbench` - ``giantmodel bench hw``: measure this machine.
"""

from giantmodel.planner.preflight import register as _register_preflight

_register_preflight()   # train's memory preflight (giantmodel.core.memory_hook)
