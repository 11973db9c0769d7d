"""The small core every layer above may use: loss, precision, optimizer and
learning-rate builders, pipeline stage planning and layout validation.

Pure functions and small classes of the config and of plain tensors: nothing
here creates a process group or knows a model family.
"""
