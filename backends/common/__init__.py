"""Engine code every backend shares, with no backend of its own: what is done with a DeepSpeed
engine (``deepspeed.py``: its CPU accelerator, ``zero.Init``, the NVMe gradient-read repair,
counting what it holds, gathering its parameters) and with torch's wrappers (``torch.py``:
full state dicts, bytes held), and the config-class -> builder registry each engine's
``families/`` package keeps an instance of (``builders.py``)."""
