"""Tensor parallelism in one place: a target over N processes (Megatron's layout, as gpt-fast's
``tp.py`` applies it to a built model; the model files stay the textbook).

- :mod:`~refspec.models.tp.plan`: which heads and MLP columns each rank keeps (pure arithmetic);
- :mod:`~refspec.models.tp.group`: the process group torchrun started, and its collectives;
- :mod:`~refspec.models.tp.shard`: a built model cut to one rank's share, its all-reduces in;
- :mod:`~refspec.models.tp.loading`: one rank's share read straight from safetensors;
- :mod:`~refspec.models.tp.rank_meter`: every rank's energy of a phase, gathered;
- :mod:`~refspec.models.tp.interconnect`: what the all-reduces add to the roofline.

``refspec.models.prepare_target(model, tp=group)`` applies it for a run.
"""
