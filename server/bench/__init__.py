"""``tokenwire bench``: the engine against what one would run instead, and against the hardware.

A tool, not part of the engine: nothing that serves imports it. ``paths`` runs the workload on each path,
``floor`` measures the matmul-only floor of a decode step and the step profile, ``models`` builds randomly
initialised models of known shapes, ``machine`` says what CPU this is, ``main`` is the command.
"""
