"""One module per strategy family: its typed config (``@family``), its problems, its topology,
footprint and parallelize plan, as data. ``import strategies`` imports every module here, so a new
family is one new module (and its presets in conf/strategy/); backends add a builder for it
under ``backends/<engine>/families/``."""
