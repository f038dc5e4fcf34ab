# %% [markdown]
# # Lecture 6: latency targets and their energy premium
#
# **Claim 6.** Meeting a tighter latency target with speculation costs extra energy; larger
# batches without speculation lower energy per token.
#
# A service promises its users a time per output token (TPOT), for instance "p99 TPOT at most
# 50 ms". The operator picks a configuration (batch, drafter, K) that meets the promise at the
# least energy per token. The cheapest configurations are plain decoding at large batch: the
# weight read is shared by many users (lecture 1). But a large batch is slow per user: each
# step computes for everyone. Speculation makes each user faster (several tokens per step) at
# some energy cost once the batch is large (lecture 1 again). So a tight target forces either a
# small batch (expensive per token) or speculation (expensive at large batch): the difference to
# the loosest target's choice is the **premium** of the tighter target.
#
# **Measured, modelled or injected?** **Modelled**: every configuration's TPOT and J/token come
# from the roofline of Llama-3.1-8B with an EAGLE head on a data-sheet H100, at an **injected**
# acceptance of 0.7 per draft. The model has no queueing or variance, so its TPOT is a mean and
# stands in for the p99. The choice itself is refspec's own (`cost_of_tighter_target`), the
# function `python -m refspec.eval report --latency-target` uses on measured sweeps.

# %% [markdown]
# ## 1. Every configuration of a grid

# %%
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import predict_step

target, h100 = arch("llama-3.1-8b"), get_profile("h100")
A, CONTEXT = 0.7, 512
BATCHES = [2 ** i for i in range(11)]  # 1 .. 1024
KS = [0, 1, 3, 7]

grid = []
for b in BATCHES:
    for k in KS:
        p = predict_step(target, h100, batch=b, k=k, context=CONTEXT, acceptance=A)
        grid.append({"batch": b, "k": k, "drafter": "none" if k == 0 else "eagle", "tpot_p99_s": p.tpot_s,
                     "energy_per_token_j": p.j_per_token})
print(f"{len(grid)} configurations; TPOT from {min(r['tpot_p99_s'] for r in grid) * 1e3:.2f} "
      f"to {max(r['tpot_p99_s'] for r in grid) * 1e3:.2f} ms")

# %% [markdown]
# ## 2. The cheapest configuration under each target

# %%
from refspec.energy.accounting.latency import cost_of_tighter_target, format_targets

TARGETS_S = [0.030, 0.020, 0.015, 0.010, 0.008, 0.006, 0.005, 0.004, 0.003, 0.0025, 0.002]
rows = cost_of_tighter_target(grid, TARGETS_S)
print(format_targets(rows))

# %% key
feasible = [r for r in rows if r["feasible"]]
loose, tight = feasible[0], feasible[-1]
print(f"loosest target {loose['target_s'] * 1e3:g} ms: {loose['drafter']} k{loose['k']} b{loose['batch']}, "
      f"{loose['energy_per_token_j']:.4f} J/token")
print(f"tightest target met {tight['target_s'] * 1e3:g} ms: {tight['drafter']} k{tight['k']} b{tight['batch']}, "
      f"{tight['energy_per_token_j']:.4f} J/token")
print(f"premium of the tightest target: {tight['extra_vs_loosest']:+.1%}")

# %% [markdown]
# Read the table from the top: the loosest target is met by plain decoding at the largest
# batch, the cheapest configuration of all. Tightening the target shrinks the batch, and
# speculation enters: it meets the target at a larger batch than plain decoding could, so
# `spec vs plain` (the choice against the best plain configuration meeting the same target) is
# negative. Below plain decoding's TPOT at batch 1 only speculation meets the target at all
# (`n/a`), and only at small batches. The **premium** (`vs loosest`) is what the tighter target
# costs: it grows steeply as the target tightens. Both halves of the claim are in the table:
# a tighter target met by speculation costs energy, and without a target the largest plain
# batch is cheapest.

# %% [markdown]
# ## 3. The frontier
#
# Each line is one K across batches (batch 1 at the top left); a star marks each target's choice.

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7.5, 4))
for i, k in enumerate(KS):
    pts = sorted((r["tpot_p99_s"] * 1e3, r["energy_per_token_j"]) for r in grid if r["k"] == k)
    ax.loglog(*zip(*pts), "o-", color=f"C{i}", ms=4, label="plain" if k == 0 else f"EAGLE K={k}")
for r in feasible:
    ax.axvline(r["target_s"] * 1e3, color="0.85", lw=0.8, zorder=0)
    ax.plot(r["tpot_p99_s"] * 1e3, r["energy_per_token_j"], "k*", ms=10)
ax.set_xlabel("TPOT, ms (modelled)")
ax.set_ylabel("J/token (modelled, H100)")
ax.set_title("batch 1 (top left) to 1024; stars: the choice per target")
ax.legend()
plt.show()

# %% [markdown]
# ## The same on measured runs
#
# On a GPU, a sweep gives each configuration a measured p99 TPOT and a steady-state J/token,
# and the report picks per target:
#
# ```bash
# python -m refspec.eval sweep --batch 1,8,32,64 --k 0,3,7 --drafter eagle --corpus conversation --out runs/targets
# python -m refspec.eval report runs/targets --latency-target 0.05
# ```
#
# A configuration whose steady-state window is invalid (too short or too empty to trust) is
# never chosen: its J/token is not a server's.
#
# ## What a GPU run would change
#
# Measured TPOT has a tail: the p99 is set by steps that refill several slots at once
# (prefill) and by requests that accept little, so speculation's p99 gain is smaller than its
# mean gain, and the premium larger. The energy would be measured over the window. On this CPU,
# a sweep of SmolLM2 would measure the CPU, whose ridge is low: speculation turns into a loss
# at a small batch, so the CPU's frontier is not an H100's.
#
# ## Exercises
#
# 1. Lower the acceptance to 0.5. Which targets stop being feasible, and what happens to the
#    premium?
# 2. Add `k=15` to the grid. Is it ever chosen? Why (lectures 1 and 2)?
# 3. Using the lab, make a small grid of your own on SmolLM2 with `meter="roofline:h100"`
#    (plain and n-gram, batches 1 and 4) and pass each `Report`'s `tpot_p99_s` and
#    `j_per_token_window` to `cost_of_tighter_target`.
#
# <details><summary>Answers</summary>
#
# 1. Fewer tokens per step make every speculative configuration slower and dearer: the tightest
#    targets become infeasible or are met only at a smaller batch, and the premium grows.
# 2. Rarely or never: K = 15 verifies 16 positions per request, turning compute-bound at small
#    batch; at a = 0.7 its extra tokens per step (3.3 against 2.5 for K = 7) do not repay it.
# 3. `records = [{"batch": r.batch, "drafter": r.drafter, "k": r.k, "tpot_p99_s": r.tpot_p99_s,
#    "energy_per_token_j": r.j_per_token_window, "window_valid": r.window_valid} for r in reports]`;
#    note that short runs often have invalid windows, which are never chosen.
#
# </details>
