# %% [markdown]
# # Lecture 7: DVFS headroom, modelled, and why it cannot be measured without clock control
#
# **Claim 7.** Little headroom is left for latency-preserving DVFS: lowering the GPU's SM clock
# at equal latency saves little energy.
#
# Dynamic voltage and frequency scaling (DVFS) lowers a chip's clock and, with it, its supply
# voltage; the dynamic energy of each operation falls roughly with the square of the voltage.
# A memory-bound step does not need a fast SM clock: its time is the time to stream the weights
# from HBM, whose clock is separate. So in principle a decode server could lower the SM clock,
# keep its latency and save energy. The claim is that little of this is left: memory-bound
# decoding spends its energy on bytes and static power, not on FLOPs, and where FLOPs do matter
# (large batch, speculation) the step is near the ridge and a lower clock costs latency.
#
# **Measured, modelled or injected?** Everything here is **modelled**, including the clock: the
# GPU is a roofline H100 whose SM clock this notebook scales. The sweep itself is refspec's
# (`dvfs_sweep`, the function a user runs on their own GPU with locked clocks); only the GPU
# behind it is a model. Acceptance is **injected** (0.7).
#
# ## 1. A model of an H100 at a lower SM clock
#
# Assumptions, each one a simplification a measurement would replace:
#
# * peak FLOP/s scales with the SM clock (1980 MHz is the H100's maximum);
# * the voltage falls linearly from 1.0 at 1980 MHz to `V_MIN` at 900 MHz, and the energy per FLOP
#   with its square;
# * HBM bandwidth, energy per byte and static power do not change (the memory has its own clock);
#   `BW_KNEE` (None here) can make bandwidth fall below a clock, as real memory-bound kernels do
#   when too few SM cycles are left to keep HBM busy.

# %%
import dataclasses

from refspec.energy.model.hardware import get_profile

H100 = get_profile("h100")
F_MAX, F_MIN = 1980, 900
CLOCKS = list(range(F_MIN, F_MAX, 90))


def at_clock(mhz, v_min=0.7, bw_knee=None):
    """The H100 profile with its SM clock at ``mhz`` (modelled; assumptions above)."""
    volts = v_min + (1 - v_min) * (mhz - F_MIN) / (F_MAX - F_MIN)
    bandwidth = H100.bandwidth_Bps * (1.0 if bw_knee is None else min(1.0, mhz / bw_knee))
    return dataclasses.replace(H100, name=f"h100@{mhz}MHz", peak_flops=H100.peak_flops * mhz / F_MAX,
                               pj_per_flop=H100.pj_per_flop * volts ** 2, bandwidth_Bps=bandwidth)


print(f"at {F_MIN} MHz: {at_clock(F_MIN).peak_flops / 1e12:.0f} TFLOP/s, ridge {at_clock(F_MIN).ridge:.0f} FLOP/B, "
      f"{at_clock(F_MIN).pj_per_flop:.2f} pJ/FLOP")

# %% [markdown]
# ## 2. A GPU whose clock can be locked: the model behind refspec's sweep
#
# `dvfs_sweep(run_fn, clocks, backend=...)` runs the workload unlocked, then locked at each clock,
# checks that each lock held, and returns the lowest clock whose p99 TPOT stays within 5 % of
# the unlocked run (the **headroom**) and the cheapest such point. On a real GPU the backend is
# Zeus (setting clocks needs root); here it is a small class that remembers the lock, and the
# workload is the roofline's prediction at that clock.

# %%
from refspec.energy.model.architectures import arch
from refspec.energy.meters.dvfs import dvfs_sweep
from refspec.energy.model.roofline import predict_step


class ModelledGPU:
    """A GPU for ``dvfs_sweep`` whose SM clock is a number in this notebook."""

    def __init__(self):
        self.mhz = F_MAX

    def set_locked_clocks(self, gpu, min_mhz, max_mhz):
        self.mhz = max_mhz

    def reset_locked_clocks(self, gpu):
        self.mhz = F_MAX

    def sm_clock_mhz(self, gpu):
        return self.mhz

    def supported_sm_clocks(self, gpu):
        return CLOCKS + [F_MAX]


target = arch("llama-3.1-8b")


def sweep(batch, k, **assumptions):
    gpu = ModelledGPU()

    def workload():
        p = predict_step(target, at_clock(gpu.mhz, **assumptions), batch=batch, k=k, context=512, acceptance=0.7)
        return {"energy_per_token_j": p.j_per_token, "tpot_p99_s": p.tpot_s}

    return dvfs_sweep(workload, CLOCKS, backend=gpu, tolerance=0.05)


POINTS = [(1, 0), (1, 3), (64, 0), (64, 3), (256, 3)]
results = {(b, k): sweep(b, k) for b, k in POINTS}

# %% key
for (b, k), s in results.items():
    print(f"batch {b} K={k}: headroom down to {s.headroom_mhz} MHz, saving at equal latency {s.energy_saving:.1%}")

# %% [markdown]
# Three regimes:
#
# * **batch 1**: the clock can fall all the way (the step is memory-bound), but there is
#   almost nothing to save: the step's energy is the weight read and the static power.
# * **batch 256 with speculation**: the verify step is compute-bound (lecture 1); a lower clock
#   lengthens it at once, so the headroom is nearly nil.
# * **batch 64**: memory-bound, yet with enough FLOPs per byte that their energy matters. Here
#   this model finds a real saving. The paper reports little headroom on its GPUs; this model
#   agrees at the two ends and not in the middle, and its middle rests on the two assumptions a
#   model cannot check: how voltage falls with the clock, and whether memory-bound kernels keep
#   their bandwidth at a low SM clock. That is what a measurement has to settle.

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7.5, 3.8))
for (b, k), s in results.items():
    pts = sorted((p.clock_mhz, 100 * (1 - p.energy_per_token_j / s.baseline.energy_per_token_j)) for p in s.points
                 if p.tpot_p99_s <= s.baseline.tpot_p99_s * (1 + s.tolerance))
    if pts:
        ax.plot(*zip(*pts), "o-", ms=3, label=f"batch {b}, K={k}")
ax.set_xlabel("locked SM clock, MHz (only clocks within 5 % of the unlocked TPOT)")
ax.set_ylabel("energy saving at equal latency, %")
ax.set_title("modelled H100, Llama-3.1-8B + EAGLE, a = 0.7")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. The same sweep under other assumptions
#
# Let bandwidth fall below 1,500 MHz (`bw_knee=1500`) and the voltage curve flatten
# (`v_min=0.85`): both are plausible, and neither can be read off a data sheet.

# %%
pessimistic = {(b, k): sweep(b, k, v_min=0.85, bw_knee=1500) for b, k in POINTS}

# %% key
for (b, k), s in pessimistic.items():
    print(f"other assumptions, batch {b} K={k}: headroom down to {s.headroom_mhz} MHz, "
          f"saving {s.energy_saving:.1%}")

# %% [markdown]
# ## 4. Why this cannot be measured here
#
# A measurement needs the clock **locked** at each point (`nvidia-smi -lgc`, or Zeus's
# `set_gpu_locked_clocks`), which takes root or `CAP_SYS_ADMIN`, and then verified under load
# (an idle GPU reads below any lock; `dvfs_sweep` samples the clock while the workload runs and
# refuses a lock that did not hold). Locks outlive the process, so they must be reset in every
# exit path. Shared and lent GPUs are for reading clocks only: `python -m refspec.eval paper`
# reads the SM clock passively and reports claim 7 as "not measurable here"; on your own GPU,
# `python -m refspec.eval dvfs` lists the clocks you can lock. A CPU laptop has neither clock
# control nor, usually, a readable energy counter.
#
# ## What a GPU run would change
#
# Everything in this lecture: on a GPU you own, the same `dvfs_sweep` with the default (Zeus)
# backend and a `run_fn` that serves a stream through refspec and returns the accounting's
# window J/token and p99 TPOT measures the curve this notebook assumed. The model's job here is
# to show which quantities decide the answer.
#
# ## Exercises
#
# 1. Tighten the latency tolerance to 1 % (`tolerance=0.01` in `dvfs_sweep`). Which regime
#    loses its headroom?
# 2. Which single assumption, if wrong, removes most of the batch-64 saving? Try each alone.
# 3. Why does speculation at batch 1 (K = 3) leave a little more to save than plain decoding at
#    batch 1, although both are memory-bound?
#
# <details><summary>Answers</summary>
#
# 1. Batch 256 with speculation: its verify step is compute-bound, so no lower clock stays
#    within 1 % (headroom None, no saving). Batch 64 with K = 3 keeps a little (its headroom
#    rises to about 1,350 MHz); the memory-bound points do not change.
# 2. The voltage curve: `sweep(64, 3, v_min=0.85)` roughly halves the saving, while
#    `sweep(64, 3, bw_knee=1500)` alone hardly changes it (the clocks it forbids saved little
#    more). The energy a clock step saves is the uncertain quantity, and only a measurement at
#    locked clocks gives it.
# 3. The verify forward computes K + 1 positions per request, so the step has about four
#    times the FLOPs per byte of plain decoding: more of its energy is FLOP energy, which is
#    the only part a lower voltage reduces in this model.
#
# </details>
