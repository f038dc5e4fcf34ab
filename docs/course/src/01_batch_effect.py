# %% [markdown]
# # Lecture 1: the batch effect and the ridge
#
# **Claim 1.** During decoding every weight is read once per step. Batching shares that read
# across users; speculation shares it across the accepted tokens of one user.
# **Claim 5, first half.** So the saving of speculation shrinks as the batch grows.
#
# A decode step of Llama-3.1-8B reads about 16 GB of weights to compute one token per request.
# An H100 moves 3.35 TB/s from its memory and computes 989 TFLOP/s, so it can do about 295
# FLOPs in the time it reads one byte: the **ridge** (balance point). A step whose FLOPs per
# byte read (its **arithmetic intensity**) lies below the ridge is **memory-bound**: its time is
# the time to read the weights, whatever it computes. One token per request does about 2 FLOPs
# per weight (a multiply and an add) over 2 bytes (bf16), so a decode step of batch B has an
# intensity of about B: far below the ridge until B is in the hundreds.
#
# Speculation verifies K + 1 positions per request in one step: intensity about B (K + 1). At
# batch 1 that is almost free in time. At large batch the verify step crosses the ridge, turns
# **compute-bound**, and then costs K + 1 times a plain step while emitting fewer than K + 1
# tokens: the saving becomes a loss.
#
# **Measured, modelled or injected?** Everything here is **modelled**: the roofline model of
# `refspec.energy.model.roofline` prices each forward's FLOPs and bytes on a data-sheet H100
# (time = max(FLOPs / peak, bytes / bandwidth) + a launch overhead; energy = static power x time
# + pJ per FLOP + pJ per byte). Acceptance is **injected**: a per-draft acceptance rate a, as a
# trained EAGLE head reaches on chat (a = 0.7). No model runs, so this lecture takes seconds.

# %% [markdown]
# ## 1. The researcher's table
#
# `python -m refspec.eval roofline` prints the model's predictions for every (acceptance, K,
# batch): tokens per step, TPOT, J/token, the saving against plain decoding at the same batch,
# the verify step's intensity and whether it is memory- or compute-bound.

# %%
import subprocess
import sys

cmd = [sys.executable, "-m", "refspec.eval", "roofline", "--model", "llama-3.1-8b", "--gpu", "h100",
       "--batch", "1,8,64,256", "--k", "0,3", "--acceptance", "0.7"]
print(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

# %% [markdown]
# ## 2. The same predictions in Python
#
# `predict_step` models one steady-state step: K forwards of the draft head (an EAGLE-style
# head: one decoder layer of the target, a fc layer and the LM head), then one verify forward
# of K + 1 tokens per request over a cache of `context` tokens.

# %%
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import compute_bound_batch, predict_step

target, h100 = arch("llama-3.1-8b"), get_profile("h100")
A, K, CONTEXT = 0.7, 3, 512
BATCHES = [2 ** i for i in range(11)]  # 1 .. 1024


def step(batch, k):
    return predict_step(target, h100, batch=batch, k=k, context=CONTEXT, acceptance=A)


plain = {b: step(b, 0) for b in BATCHES}
spec = {b: step(b, K) for b in BATCHES}
saving = {b: 1 - spec[b].j_per_token / plain[b].j_per_token for b in BATCHES}
print(f"{'batch':>5} {'plain J/tok':>11} {'spec J/tok':>10} {'saving':>7} {'verify FLOP/B':>13}")
for b in BATCHES:
    print(f"{b:>5} {plain[b].j_per_token:>11.4f} {spec[b].j_per_token:>10.4f} {saving[b]:>7.1%} "
          f"{spec[b].verify_cost.intensity:>13.1f}")

# %% key
crossing = compute_bound_batch(target, h100, k=K, context=CONTEXT)
print(f"ridge of the h100: {h100.ridge:.0f} FLOP/B")
print(f"plain J/token at batch 1: {plain[1].j_per_token:.4f}")
print(f"plain J/token at batch 64: {plain[64].j_per_token:.4f}")
print(f"saving at batch 1: {saving[1]:.1%}")
print(f"saving at batch 64: {saving[64]:.1%}")
print(f"verify (K={K}) turns compute-bound at batch: {crossing}")

# %% [markdown]
# Read the table from the top. Plain decoding's J/token falls almost as 1/B at first: the
# weight read is shared by more users, and the static power is spread over more tokens. The
# speculative step gives each request about (1 - a^(K+1)) / (1 - a) tokens per weight read,
# so at batch 1 it saves a large part of the energy. As the batch grows, the plain step
# already shares its read among B users, so the sharing speculation adds is worth less; once
# verify crosses the ridge it costs compute time for every verified position, rejected or not.

# %% [markdown]
# ## 3. The plot

# %%
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
ax1.loglog(BATCHES, [plain[b].j_per_token for b in BATCHES], "o-", label="plain")
ax1.loglog(BATCHES, [spec[b].j_per_token for b in BATCHES], "s-", label=f"EAGLE K={K}, a={A}")
ax1.set_xlabel("batch")
ax1.set_ylabel("J/token (modelled, H100)")
ax1.legend()
ax2.semilogx(BATCHES, [100 * saving[b] for b in BATCHES], "s-", color="C1")
ax2.axhline(0, color="k", lw=0.8)
if crossing:
    ax2.axvline(crossing, ls=":", color="C3", label=f"verify compute-bound from B={crossing}")
ax2.set_xlabel("batch")
ax2.set_ylabel("saving vs plain, %")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## What a GPU run would change
#
# On a real H100 the energy coefficients (static watts, pJ per FLOP and per byte) are priors
# here; a measured run (`python -m refspec.eval paper` on a GPU, `docs/gpu.md`) calibrates them
# and reads the counter. Real kernels do not reach the data-sheet peak or bandwidth, and a step
# has more overhead than one launch per forward, so the crossing moves, usually to smaller
# batches (attention and the LM head are less efficient than the big matrix products). The
# shape of the curves, a saving that shrinks and turns into a loss, is what the paper measured.
#
# ## Exercises
#
# 1. Where does the naive estimate B (K + 1) = ridge put the crossing for K = 3, and why does
#    `compute_bound_batch` find a larger batch?
# 2. Repeat the table with `context=4096`. Does the crossing move up or down, and why?
# 3. At which batch does plain decoding itself turn compute-bound on the H100 (K = 0)?
#
# <details><summary>Answers</summary>
#
# 1. B = 295 / 4, about 74. The model counts more bytes than the weights: every request reads
#    its own KV cache (context x 2 x layers x KV heads x head dim x 2 bytes), and that traffic
#    grows with B as fast as the FLOPs do, so a larger batch is needed to reach the ridge
#    (the roofline command prints 111).
# 2. Up, out of reach: at 4096 tokens `compute_bound_batch` returns None. Every request reads its
#    own KV cache (and does few FLOPs per KV byte), so a longer context lowers the intensity at
#    every batch; the weights, read once for all, no longer dominate the bytes.
# 3. `compute_bound_batch(target, h100, k=0, context=512)`: none below 65,536 at this context
#    (the command says so): the KV reads keep one-token steps memory-bound. Plain decoding never
#    pays the compute-bound penalty; only verifying several positions per request does.
#
# </details>
