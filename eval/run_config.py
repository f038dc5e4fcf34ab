"""The identity of one evaluation configuration: :class:`RunConfig`.

A :class:`RunConfig` names everything that changes a figure (model, drafter, K, policy, batch,
corpus, budget, dtype, device, meter, sampling, seed, injection, tensor parallelism); its
``config_id`` is readable and unique per identity, and it is built only at the CLI edge
(:mod:`refspec.eval.cli_args`). :mod:`refspec.eval.run` runs one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from refspec.eval.flags import UsageError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that identifies one configuration (built only at the CLI edge).

    Attributes:
        model: model id (``refspec.assets``) or Hugging Face directory.
        drafter: registered drafter name, or ``"none"`` for plain decoding.
        k: drafts per step (0 for ``none``; a tree's node budget with ``tree``).
        batch: rows per batch B.
        corpus: built-in corpus name or prompt file.
        num_prompts: at most this many distinct prompts (None: as many as requests).
        max_new_tokens: the budget cap N: each request's own budget is at most N.
        dtype: ``fp32``, ``bf16`` or ``fp16`` (resolved, never ``auto``).
        device: torch device string (resolved).
        meter: meter kind (``auto``, ``zeus``, ``roofline``, ``roofline:<profile>``, ``time``).
        temperature / top_k / top_p: sampling (temperature 0 is greedy).
        seed: seed of the sampling and injection generators.
        tree: EAGLE-2 dynamic tree drafting.
        cuda_graphs: verify through CUDA graphs (resolved).
        accept_model: injected acceptance model name or file, or None.
        drafter_options: extra drafter options, sorted ``(key, value)`` pairs.
        chat: render chat prompts with the chat template.
        schedule: ``continuous`` (slots refilled from the stream) or ``static`` (lockstep batches).
        requests: requests served (None: :func:`refspec.eval.requests.default_requests`).
        request_rate: open-loop Poisson arrivals per second, None for closed loop.
        output_len_dist: how the budgets are drawn below N (:class:`refspec.eval.requests.LengthDist`):
            ``auto``, ``reference``, ``fixed`` or ``uniform:R``.
        tp: tensor-parallel ranks the target is sharded over (``--tp``; 1: one device).
        spec_policy: the speculation policy's spec (:mod:`refspec.policy`); ``k`` is then the
            largest K a step may draft.
    """

    model: str
    drafter: str
    k: int
    batch: int
    corpus: str
    num_prompts: int | None
    max_new_tokens: int
    dtype: str
    device: str
    meter: str = "auto"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    tree: bool = False
    cuda_graphs: bool = False
    accept_model: str | None = None
    drafter_options: tuple[tuple[str, str], ...] = ()
    chat: bool = True
    schedule: str = "continuous"
    requests: int | None = None
    request_rate: float | None = None
    output_len_dist: str = "auto"
    tp: int = 1
    spec_policy: str = "fixed"

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise UsageError(f"batch must be >= 1, got {self.batch}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UsageError(f"num-prompts must be >= 1, got {self.num_prompts}")
        if self.schedule not in ("continuous", "static"):
            raise UsageError(f"schedule must be continuous or static, got {self.schedule!r}")
        if self.requests is not None and self.requests < 1:
            raise UsageError(f"requests must be >= 1, got {self.requests}")
        if self.request_rate is not None and not (0 < self.request_rate < math.inf):
            raise UsageError(f"request rate must be a positive number, got {self.request_rate}")
        if self.request_rate is not None and self.schedule == "static":
            raise UsageError("--request-rate needs --schedule continuous (static batches have no arrivals)")
        if self.max_new_tokens < 1:
            raise UsageError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        from refspec.eval.requests import LengthDist

        try:
            LengthDist.parse(self.output_len_dist)
        except ValueError as exc:
            raise UsageError(f"--output-len-dist: {exc}") from None
        if self.tp < 1:
            raise UsageError(f"--tp must be >= 1, got {self.tp}")
        if self.k < 0:
            raise UsageError(f"k must be >= 0, got {self.k}")
        if (self.drafter == "none") != (self.k == 0):
            raise UsageError(f"drafter {self.drafter!r} with k={self.k}: k = 0 means no drafter (the baseline)")
        if self.accept_model is not None and self.drafter == "none":
            raise UsageError("--accept-model injects acceptance of drafts; it needs a drafter and k >= 1")
        if self.accept_model is not None and self.tree:
            raise UsageError("--accept-model injects chain acceptance only; drop --tree")
        from refspec.eval.policy_setup import check_policy_for, checked_spec

        spec = checked_spec(self.spec_policy)
        check_policy_for(spec, k=self.k, tree=self.tree, drafter=self.drafter)
        object.__setattr__(self, "spec_policy", spec.name)

    @property
    def is_baseline(self) -> bool:
        return self.drafter == "none"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_requests(self) -> int:
        """Requests served: ``requests``, or the default stream for the batch."""
        from refspec.eval.requests import default_requests

        return self.requests if self.requests is not None else default_requests(self.batch)

    def identity(self) -> dict[str, Any]:
        """The JSON-ready settings that identify the configuration."""
        d = dataclasses.asdict(self)
        d["drafter_options"] = {k: v for k, v in self.drafter_options}
        if self.tp == 1:
            del d["tp"]  # one device: the ids of runs before --tp existed stay valid
        if self.spec_policy == "fixed":  # likewise the ids of runs before speculation policies
            del d["spec_policy"]
        return d

    @property
    def config_id(self) -> str:
        """``<drafter>-k<K>[-<policy>]-b<B>-<corpus>-<hash>``: readable, and unique per identity."""
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:10]
        corpus = Path(self.corpus).stem if ("/" in self.corpus or self.corpus.endswith(".jsonl")) else self.corpus
        tree = "-tree" if self.tree else ""
        inj = "-injected" if self.accept_model else ""
        sched = "-static" if self.schedule == "static" else ""
        pol = "" if self.spec_policy == "fixed" else "-" + self.spec_policy.replace(":", "-").replace(",", "_")
        return f"{self.drafter}-k{self.k}{tree}{pol}-b{self.batch}{sched}-{corpus}{inj}-{digest}"

    @property
    def label(self) -> str:
        """Short label for tables and progress bars."""
        sched = (" static" if self.schedule == "static" else "") + (f" tp{self.tp}" if self.tp > 1 else "")
        if self.is_baseline:
            return f"none b{self.batch}{sched}"
        pol = "" if self.spec_policy == "fixed" else f" {self.spec_policy}"
        return f"{self.drafter}{' tree' if self.tree else ''} k{self.k}{pol} b{self.batch}{sched}"

    def baseline(self) -> "RunConfig":
        """The no-drafter configuration at the same batch, corpus, budget and settings."""
        return dataclasses.replace(self, drafter="none", k=0, tree=False, accept_model=None, drafter_options=(),
                                   spec_policy="fixed")


__all__ = ["RunConfig"]
