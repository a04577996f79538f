"""The ground floor: what every other package of ours may read and that reads none of them --
errors, knobs, where conf/ is, the run's facts. Engine-free and torch-free at import (a torch
dtype is named by string and resolved where it is used).

Today it holds the precision vocabulary (``core.precision``); the errors, the declared field
checks, conf/'s location and the run's facts move here from ``strategies/`` later.
"""
