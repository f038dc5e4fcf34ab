"""The grid's drafters on a random-weight target, and the acceptance injected into them.

* ``eagle``: an EAGLE-1-shaped chain head (one decoder layer of the target's shape, ``fc``
  2E -> E, the target's LM head), untrained: :class:`refspec.drafters.eagle.EagleDrafter`.
* ``block``: a block head (one layer over the target's low, middle and high features, block
  size 16, serving K = 8 and 16): :class:`refspec.drafters.block.BlockDrafter`.

Both are the real drafters' code at real shapes; their heads run eagerly (no graph capture).
Their drafts are meaningless, so every k > 0 point injects acceptance
(:func:`refspec.eval.injection.make_acceptance_fn`) from a distribution recorded per
(drafter, corpus) on the small real models (``acceptance_smollm2.json`` beside this file,
made by ``python -m refspec.eval sweep ... --export-acceptance``; its provenance says how).

:class:`Recorder` wraps a drafter for the engine and keeps a copy of one mid-run
:class:`~refspec.drafting.DecodeState`, so the phase-isolated draft loop can repeat exactly the
draft phase of that step (``commit`` then ``propose`` on the same state rewrite the same slots).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from gpucheck.grid import DrafterSpec

ACCEPTANCE_FILE = Path(__file__).with_name("acceptance_smollm2.json")
BLOCK_SIZE = 16


def build_drafter(spec: DrafterSpec, target: Any, kv_bucket: int, heads: dict[str, Any]) -> Any:
    """A fresh drafter of ``spec`` for ``target``; its head is built once per target in ``heads``."""
    if spec.name == "none":
        return None
    if spec.name == "eagle":
        from refspec.drafters.eagle import EagleDrafter, HeadConfig, new_head

        if "eagle" not in heads:
            torch.manual_seed(0)
            with torch.device(target.device):  # built in place: no host copy of an 8B-shaped layer
                head = new_head(HeadConfig.for_target("eagle", target.args))
            for p in head.parameters():  # the target's dtype; rotary buffers stay fp32 (as load_head does)
                p.data = p.data.to(target.dtype)
            heads["eagle"] = head.eval().requires_grad_(False)
        return EagleDrafter(heads["eagle"], target, kv_bucket=kv_bucket)
    from refspec.drafters.block import BlockDrafter, BlockHead, BlockHeadConfig, default_feature_layers

    if "block" not in heads:
        torch.manual_seed(0)
        cfg = BlockHeadConfig(feature_layers=default_feature_layers(target.num_layers), block_size=BLOCK_SIZE)
        with torch.device(target.device):
            heads["block"] = BlockHead(target.args, cfg)
    return BlockDrafter(heads["block"], target, kv_bucket=kv_bucket)


def acceptance_model(spec: DrafterSpec, corpus: str, accept_file: Path | None) -> Any:
    """The recorded distribution of ``spec``'s drafter on ``corpus``, at its k."""
    from refspec.eval.injection import resolve_acceptance_model

    return resolve_acceptance_model(str(accept_file or ACCEPTANCE_FILE), k=spec.k, drafter=spec.name, corpus=corpus)


def recorded_taus(accept_file: Path | None, corpora: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """Mean tau of each (drafter, corpus) in the file at its recorded K (for the plan)."""
    from refspec.eval.injection import load_acceptance_models

    return {(m.drafter, m.corpus): m.mean_tau for m in load_acceptance_models(accept_file or ACCEPTANCE_FILE)
            if m.corpus in corpora}


def _clone(state: Any) -> Any:
    return dataclasses.replace(state, **{f.name: getattr(state, f.name).clone() for f in dataclasses.fields(state)
                                         if isinstance(getattr(state, f.name), torch.Tensor)},
                               hidden=[h.clone() for h in state.hidden])


class Recorder:
    """A drafter the engine drives, unchanged, that copies the state it is given at step ``at_step``."""

    def __init__(self, drafter: Any, at_step: int) -> None:
        self._drafter = drafter
        self._at = at_step
        self.state: Any = None

    def __getattr__(self, name: str) -> Any:  # name, hidden_layers, extra_slots, reset, reset_rows, ...
        return getattr(self._drafter, name)

    def propose(self, state: Any, k: int) -> Any:
        if state.step == self._at and self.state is None:
            self.state = _clone(state)
        return self._drafter.propose(state, k)

    def commit(self, state: Any) -> None:
        self._drafter.commit(state)

    @property
    def inner(self) -> Any:
        return self._drafter


def draft_call(recorder: Recorder, k: int) -> Any:
    """One draft phase of the recorded step, repeatable: ``commit`` then ``propose`` on its state."""
    state, drafter = recorder.state, recorder.inner
    if state is None:
        raise RuntimeError("the run ended before the recorded step; no draft state to loop on")

    def call() -> None:
        drafter.commit(state)
        drafter.propose(state, k)
    return call
