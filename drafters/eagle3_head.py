"""The EAGLE-3 head (Li et al. 2025): three fused target layers, attention over
``[norm(embed), norm(feature)]``, its own final norm and LM head over an optional reduced
draft vocabulary (``d2t`` maps a draft id d to target id ``d + d2t[d]``; ``t2d`` marks target
ids in the draft vocabulary). The shared body is :class:`refspec.drafters.eagle_body.EagleHead`.
"""
from __future__ import annotations

import torch
from torch import nn

from refspec.drafters.eagle_body import EagleHead, HeadConfig
from refspec.models.layers import Linear, RMSNorm


class Eagle3Head(EagleHead):
    """EAGLE-3 head: ``fc`` fuses three target layers; attention reads ``[norm(embed), norm(h)]``;
    own final norm and LM head over the draft vocabulary."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg, 2 * cfg.hidden_size)
        e = cfg.hidden_size
        self.fc = Linear(3 * e, e, bias=cfg.fc_bias)
        self.input_norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.hidden_norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.norm = RMSNorm(e, cfg.rms_norm_eps, plus_one=False)
        self.lm_head = Linear(e, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install a reduced vocabulary: ``draft_to_target [Vd]`` ascending target ids."""
        vd = self.config.draft_vocab_size
        assert draft_to_target.shape == (vd,), f"expected {vd} target ids"
        self.d2t.copy_(draft_to_target - torch.arange(vd, device=draft_to_target.device))
        self.t2d.zero_()
        self.t2d[draft_to_target] = True

    def _prepare_matrices(self) -> list[nn.Linear]:
        return [self.fc]

    def prepare(self, feats: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(feats, dim=-1).to(self.fc.weight.dtype))

    def _attn_input(self, emb, h):
        normed = self.hidden_norm(h)
        residual = normed if self.config.norm_before_residual else h
        return torch.cat([self.input_norm(emb), normed], dim=-1), residual

    def draft_logits(self, out: torch.Tensor, target) -> torch.Tensor:
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
