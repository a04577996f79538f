"""The torch side of parallelism, as torchtitan's ``distributed/``: what a family's plan does to
the plain model (``parallelize.py``: TP, context parallelism, activation checkpointing, compile,
FSDP2, in that order), cutting it into pipeline stages (``pipeline.py``, with the schedules'
arithmetic the planner reads), a MoE model's experts over an expert-parallel group
(``experts.py``), torch's ring attention (``context_parallel.py``), the global gradient norm and
clipping by it (``clip.py``) and live-tensor byte counting (``memory.py``). Engine-free; torch is
imported where it is used, so the planner can read the arithmetic without it.
"""
