"""refspec: a pure-PyTorch reference speculative decoder with an auditable energy ledger.

The decode core, read top-down:

1. :mod:`refspec.config`: ``ModelArgs``, the architecture of a target or a drafter head.
2. :mod:`refspec.cache`: the static KV cache ``[L, B, Hkv, T, D]`` with per-row lengths, and
   the masks built from them (causal, sliding window, tree).
3. :mod:`refspec.sampling`: greedy choice and the warped distribution (temperature, top-k,
   top-p) that both target and drafter sample from.
4. :mod:`refspec.verify`: pure acceptance functions (greedy prefix match, lossless rejection
   sampling); :mod:`refspec.verify_tree` the same for trees (recursive rejection sampling); no
   model calls.
5. :mod:`refspec.drafting`: the drafter protocol, what a drafter sees (``DecodeState``) and
   returns (``Draft``); :mod:`refspec.target`: the target protocol, what the loop calls on a
   target (its forward, packed prefill, cache).
6. :mod:`refspec.engine`: the one loop, plain decoding being K = 0: draft, verify, accept,
   commit, refill, every phase metered; the step's verify, acceptance, commit and slot filling
   (a packed prefill) in :mod:`refspec.step`, K per step from :mod:`refspec.policy`, the
   slot/queue/clock bookkeeping of continuous batching in :mod:`refspec.scheduler`, the request
   and result types in :mod:`refspec.serving`.
7. :mod:`refspec.cuda_graphs`: the verify forward captured once per shape and replayed (its static
   buffers in :mod:`refspec.graph_buffers`).
8. :mod:`refspec.phase_loops`: each phase of a step alone in a loop, for a counter that cannot
   see one phase.

Rooms beside the core: :mod:`refspec.energy` (meters, ledger, accounting, roofline, latency,
DVFS, attribution) and :mod:`refspec.assets` (pinned real models, download, GGUF conversion,
tokenizer). Layers outside it: ``refspec.models`` (targets, and ``prepare_target``, which readies
one for a run: CPU GEMM plan, compiled step, CUDA graphs, tensor parallelism in
``refspec.models.tp``), ``refspec.drafters`` (one file per drafter), ``refspec.eval`` (every
command line). The core imports none of these three.

Shape glossary, used in every shape comment:

==== =======================================================
B    batch rows (slots)
S    query tokens per row in one forward
T    cache slots per row (keys)
K    draft tokens per row per step
N    tree nodes per row
P    longest path a step can accept (K for a chain, the tree's depth for a tree)
L    decoder layers
H    query heads; Hkv key/value heads
D    head dimension
E    model (hidden) dimension
V    vocabulary size
==== =======================================================
"""

__version__ = "0.1.0"
