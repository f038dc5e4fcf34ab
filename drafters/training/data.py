"""Training data for drafters: sequences, the frozen target's features, batches.

The first two steps of drafter training (see :mod:`refspec.drafters.training` for the whole):

1. **text -> sequences**: :func:`self_distill` turns training prompts into the target's own
   greedy responses (:class:`TrainingSequence`, with the position training starts from).
2. **sequences -> features**: :func:`collect_features` runs the frozen target over the
   sequences once and keeps, per position, the hidden states of the layers a trainer asks for
   and the target's argmax (the greedy label), as a :class:`FeatureDataset` (flat tensors
   plus offsets) that saves to and loads from safetensors; :meth:`FeatureDataset.sample`
   draws training :class:`Batch` es.

Shapes: B batch, S sequence length, E model dim, N total positions in a dataset.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot start or resume (the message says what to change)."""


# ---- datasets -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch of training windows cut from a :class:`FeatureDataset`.

    Attributes:
        tokens: ``[B, S]`` token ids (0 past a window's end).
        hidden: one ``[B, S, E]`` float32 tensor per dataset layer, in ``FeatureDataset.layers``
            order; ``hidden[j][b, i]`` is the target's state at position i of the window.
        labels: ``[B, S]`` the target's greedy next token after position i (its argmax).
        loss_mask: ``[B, S]`` bool, whether position i's next-token prediction is trained on
            (False on prompts the target did not write and past a window's end).
        valid: ``[B, S]`` bool, whether position i holds a real token.
        layers: the layer of each entry of ``hidden``.
    """

    tokens: torch.Tensor
    hidden: list[torch.Tensor]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    valid: torch.Tensor
    layers: tuple[int, ...] = ()

    def of(self, layer: int) -> torch.Tensor:
        """``[B, S, E]`` hidden states of one target layer."""
        try:
            return self.hidden[self.layers.index(layer)]
        except ValueError:
            raise TrainingError(f"the batch holds layers {self.layers}, not {layer}") from None


@dataclasses.dataclass
class FeatureDataset:
    """Sequences with the frozen target's hidden states, stored flat.

    Sequence ``d`` occupies rows ``offsets[d]:offsets[d+1]`` of every flat tensor.

    Attributes:
        tokens: ``[N]`` token ids.
        labels: ``[N]`` the target's argmax after each position (its greedy next token).
        loss_mask: ``[N]`` bool, positions whose next-token prediction is trained on.
        hidden: ``{layer: [N, E]}`` hidden states (``Transformer.forward`` numbering: ``i < L``
            residual after block i, ``L`` final-normed), usually stored in bfloat16.
        offsets: ``[D+1]`` sequence boundaries.
        description: free-form provenance of the text (recorded in exported heads).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict[int, torch.Tensor]
    offsets: torch.Tensor
    description: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.labels.shape == (n,) and self.loss_mask.shape == (n,), "tokens, labels, loss_mask: [N]"
        assert int(self.offsets[-1]) == n, f"offsets end at {int(self.offsets[-1])}, expected {n}"
        for layer, h in self.hidden.items():
            assert h.shape[0] == n, f"hidden layer {layer} has {h.shape[0]} rows, expected {n}"

    @property
    def layers(self) -> tuple[int, ...]:
        """Stored layers, ascending (the order of ``Batch.hidden``)."""
        return tuple(sorted(self.hidden))

    @property
    def num_sequences(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """``[D]`` tokens per sequence."""
        return self.offsets[1:] - self.offsets[:-1]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """``[V]`` how often each token is a trained-on label (for reduced draft vocabularies)."""
        return torch.bincount(self.labels[self.loss_mask], minlength=vocab_size)

    def select_layers(self, layers: Iterable[int]) -> "FeatureDataset":
        """A view holding only ``layers`` (raises if one is missing)."""
        layers = tuple(layers)
        missing = [l for l in layers if l not in self.hidden]
        if missing:
            raise TrainingError(f"the dataset holds layers {self.layers}, not {missing}; collect features again")
        return dataclasses.replace(self, hidden={l: self.hidden[l] for l in layers})

    def subset(self, docs: Sequence[int]) -> "FeatureDataset":
        """A copy holding only sequences ``docs``, in that order."""
        rows = torch.cat([torch.arange(int(self.offsets[d]), int(self.offsets[d + 1])) for d in docs])  # [N']
        offsets = torch.zeros(len(docs) + 1, dtype=self.offsets.dtype)
        offsets[1:] = self.lengths[list(docs)].cumsum(0)
        return FeatureDataset(tokens=self.tokens[rows], labels=self.labels[rows], loss_mask=self.loss_mask[rows],
                              hidden={l: h[rows] for l, h in self.hidden.items()}, offsets=offsets,
                              description=self.description)

    def split(self, held_out: int, seed: int) -> tuple["FeatureDataset", "FeatureDataset"]:
        """``(train, held_out)``: ``held_out`` whole sequences drawn by a seeded permutation, the rest."""
        if not 0 < held_out < self.num_sequences:
            raise TrainingError(f"held-out sequences must be between 1 and {self.num_sequences - 1} "
                                f"(the dataset has {self.num_sequences}), got {held_out}")
        order = torch.randperm(self.num_sequences, generator=torch.Generator().manual_seed(seed)).tolist()
        return self.subset(sorted(order[held_out:])), self.subset(sorted(order[:held_out]))

    def sample_batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> Batch:
        """Cut ``batch_size`` random windows of ``seq_len`` positions.

        Sequences are drawn with probability proportional to their length (so every position
        is about equally likely); a window starts uniformly inside its sequence and is padded
        with invalid positions when the sequence is shorter.

        Args:
            batch_size: B.
            seq_len: S.
            generator: CPU generator (its state is part of every checkpoint).
        """
        lengths = self.lengths.float()
        docs = torch.multinomial(lengths, batch_size, replacement=True, generator=generator)  # [B]
        lens = self.lengths[docs]
        room = (lens - seq_len).clamp_min(0)
        start = (torch.rand(batch_size, generator=generator) * (room + 1).float()).long().clamp_max(room)
        idx = self.offsets[docs][:, None] + start[:, None] + torch.arange(seq_len)[None]  # [B, S]
        valid = (start[:, None] + torch.arange(seq_len)[None]) < lens[:, None]
        idx = torch.where(valid, idx, torch.zeros_like(idx))
        tokens = torch.where(valid, self.tokens[idx], torch.zeros_like(idx))
        labels = torch.where(valid, self.labels[idx], torch.zeros_like(idx))
        loss_mask = self.loss_mask[idx] & valid
        hidden = [self.hidden[l][idx].float() * valid[..., None] for l in self.layers]
        return Batch(tokens=tokens, hidden=hidden, labels=labels, loss_mask=loss_mask, valid=valid,
                     layers=self.layers)

    # -- persistence ------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write the dataset as one safetensors file (atomically)."""
        from safetensors.torch import save_file

        tensors = {"tokens": self.tokens.contiguous(), "labels": self.labels.contiguous(),
                   "loss_mask": self.loss_mask.to(torch.uint8).contiguous(), "offsets": self.offsets.contiguous()}
        tensors.update({f"hidden.{l}": h.contiguous() for l, h in self.hidden.items()})
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"description": json.dumps(self.description, sort_keys=True)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "FeatureDataset":
        """Read a dataset written by :meth:`save`."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
        hidden = {int(k.split(".", 1)[1]): v for k, v in t.items() if k.startswith("hidden.")}
        return cls(tokens=t["tokens"], labels=t["labels"], loss_mask=t["loss_mask"].bool(), hidden=hidden,
                   offsets=t["offsets"], description=json.loads(meta.get("description", "{}")))


@dataclasses.dataclass(frozen=True)
class TrainingSequence:
    """One training sequence before features are collected.

    Attributes:
        tokens: token ids.
        train_from: first position whose next-token prediction is trained on (e.g. the last
            prompt token of a self-distilled chat, so only the target's own reply counts).
        source: where the text came from (for provenance counts).
    """

    tokens: list[int]
    train_from: int = 0
    source: str = ""


@torch.inference_mode()
def self_distill(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int = 8,
                 eos_token_ids: Sequence[int] = (), progress: bool = True, source: str = "self-distill",
                 ) -> list[TrainingSequence]:
    """The target's own greedy replies to training prompts, as training sequences.

    Prompts are decoded in batches of similar length with plain (k = 0) decoding of
    :class:`refspec.engine.Engine`; each sequence is prompt + reply, trained from the last
    prompt token on.

    Args:
        target: the frozen target ``Transformer``.
        prompts: token ids per prompt (already chat-templated where the target expects it).
        max_new_tokens: reply budget per prompt.
        batch_size: rows decoded together.
        eos_token_ids: tokens that end a reply.
        progress: show a tqdm bar.
        source: label recorded in each sequence.

    Returns:
        One sequence per prompt, in the order of ``prompts``.
    """
    from tqdm.auto import tqdm

    from refspec.engine import Engine

    engine = Engine(target, eos_token_ids=eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[TrainingSequence | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="self-distill", unit="prompt", disable=not progress)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        gen = engine.generate([list(prompts[i]) for i in rows], max_new_tokens=max_new_tokens)
        for i, reply in zip(rows, gen.tokens):
            p = list(prompts[i])
            out[i] = TrainingSequence(tokens=p + list(reply), train_from=len(p) - 1, source=source)
        bar.update(len(rows))
    bar.close()
    return [s for s in out if s is not None]


@torch.inference_mode()
def collect_features(target, sequences: Sequence[TrainingSequence], layers: Iterable[int], *,
                     max_len: int = 512, batch_tokens: int = 4096, storage_dtype: torch.dtype = torch.bfloat16,
                     progress: bool = True, description: dict[str, Any] | None = None) -> FeatureDataset:
    """Run the frozen target over training sequences and keep what drafters learn from.

    Args:
        target: the frozen target ``Transformer`` (any dtype; bf16 is 2-4x faster on CPU).
        sequences: the training sequences (cut to ``max_len`` tokens).
        layers: hidden layers to keep (``Transformer.forward`` numbering).
        max_len: longest sequence kept, in tokens.
        batch_tokens: padded tokens per target forward (rows * longest row).
        storage_dtype: dtype of the stored hidden states.
        progress: show a tqdm bar.
        description: provenance of the text, stored with the dataset.

    Returns:
        The dataset; ``labels`` are the target's argmax at every position and the last
        position of each sequence is never trained on (its next token is unknown).
    """
    from tqdm.auto import tqdm

    layers = tuple(sorted(set(layers)))
    seqs = [s for s in sequences if len(s.tokens) >= 2]
    if len(seqs) < len(sequences):
        log.warning("dropped %d sequences shorter than 2 tokens", len(sequences) - len(seqs))
    if not seqs:
        raise TrainingError("no training sequence has 2 or more tokens")
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i].tokens))
    pieces: dict[int, list] = {}
    bar = tqdm(total=sum(min(len(s.tokens), max_len) for s in seqs), desc="target features", unit="tok",
               disable=not progress)
    i = 0
    while i < len(order):
        longest = min(len(seqs[order[i]].tokens), max_len)
        rows = order[i:i + max(1, batch_tokens // longest)]
        i += len(rows)
        for d, piece in _batch_features(target, [seqs[d] for d in rows], longest, layers, storage_dtype).items():
            pieces[rows[d]] = piece
            bar.update(piece[0].shape[0])
    bar.close()
    parts = [pieces[d] for d in range(len(seqs))]
    lengths = torch.tensor([p[0].shape[0] for p in parts])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return FeatureDataset(tokens=torch.cat([p[0] for p in parts]), labels=torch.cat([p[1] for p in parts]),
                          loss_mask=torch.cat([p[2] for p in parts]),
                          hidden={l: torch.cat([p[3][l] for p in parts]) for l in layers}, offsets=offsets,
                          description=dict(description or {}))


def _batch_features(target, seqs: Sequence[TrainingSequence], longest: int, layers: tuple[int, ...],
                    storage_dtype: torch.dtype) -> dict[int, list]:
    """One target forward over ``seqs`` (each cut to ``longest`` tokens): per row, its tokens,
    the target's argmax labels, the loss mask and the kept layers' hidden states, on the CPU."""
    final, dev, b = target.num_layers, target.device, len(seqs)
    want = tuple(sorted(set(layers) | {final}))
    toks = torch.zeros(b, longest, dtype=torch.long)
    for r, seq in enumerate(seqs):
        t = seq.tokens[:longest]
        toks[r, : len(t)] = torch.tensor(t, dtype=torch.long)
    toks = toks.to(dev)
    cache = target.new_cache(b, longest)
    pos = torch.arange(longest, device=dev)[None].expand(b, longest)
    _, hidden = target(toks, pos, cache, logits_at=pos[:, :0], hidden_layers=want)
    by_layer = dict(zip(want, hidden))
    labels = torch.cat([target.logits(by_layer[final][:, j:j + 256]).argmax(-1)
                        for j in range(0, longest, 256)], dim=1)  # [B, S]
    out: dict[int, list] = {}
    for r, seq in enumerate(seqs):
        n = min(len(seq.tokens), longest)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[max(0, seq.train_from): n - 1] = True
        out[r] = [toks[r, :n].cpu(), labels[r, :n].cpu(), mask,
                  {l: by_layer[l][r, :n].to(storage_dtype).cpu() for l in layers}]
    return out
