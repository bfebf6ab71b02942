"""Campaign scenarios: one short guarded training each, with at most one faulty rank.

The default matrix reproduces the published reference cases (AWS's HyperPod method) and the
paths replicheck adds checks for. A scenario only says what differs from the campaign's job
(:class:`JobDefaults`); everything else comes from the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from replicheck.faults.errors import FaultConfigError
from replicheck.faults.injector import Fault
from replicheck.faults.noise import KernelNoise, NoiseModel
from replicheck.guard.tolerance import choose
from replicheck.harness.jobs import JobLoss, Parallel
from replicheck.harness.workloads import DecoderConfig

Expect = Literal["detect", "undetected", "clean", "data", "refused"]
"""What a row expects: ``detect`` the fault at the first check at or after onset (right suspect);
``undetected`` (a documented limit); ``clean`` (no alarm); ``data``: an alarm at the poisoned step
classified ``data``, naming no node, on which the controller takes no action; ``refused``: the
guard refuses the setup at construction on every rank, with a message that says what to do."""
Refused = Literal["static_graph", "sync_batchnorm"]
"""Setups a ``refused`` row builds: DDP with ``static_graph=True``, or a model with SyncBatchNorm
(a collective inside forward)."""


@dataclass(frozen=True, kw_only=True)
class DataPoison:
    """A sample whose forward gives inf on any rank that computes it (a fault carried by the data).

    Every rank installs the same hook, so a re-run of the sample elsewhere reproduces it."""

    step: int
    """The step whose batch holds the sample."""
    rank: int
    """The rank whose batch holds it."""
    sample: int = -1
    """Its index in that batch (the last by default: not 0, the probe, so the per-step check
    meets it first)."""


def campaign_model() -> DecoderConfig:
    """The default campaign model: a small Llama-style decoder (2 blocks, d_model 32)."""
    return DecoderConfig(vocab=128, d_model=32, n_layers=2, n_heads=4, seq_len=16)


def soak_model() -> DecoderConfig:
    """The soak's tiny decoder (d_model 16, 1 block, 8 tokens); also the campaign's ``--tiny``."""
    return DecoderConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)


@dataclass(frozen=True, kw_only=True)
class JobDefaults:
    """The job every scenario runs unless it says otherwise."""

    nodes: int = 2
    """Simulated nodes."""
    gpus_per_node: int = 2
    """Ranks per simulated node."""
    mode: Literal["exact", "tolerant"] = "exact"
    """Guard mode."""
    verify_every: int = 10
    """Ring replay every this many steps."""
    weights_every: int | None = None
    """Weight/optimizer-state comparison period (``None``: same as ``verify_every``)."""
    steps: int = 36
    """Steps per run (0..steps-1), enough for onset 23 and the check at 30."""
    batch: int = 4
    """Sequences per rank per step."""
    model: DecoderConfig = field(default_factory=campaign_model)
    """Decoder shape."""
    seed: int = 0
    """Seed of weights, data and faults."""
    fault_rank: int = 1
    """The rank made faulty (when the scenario does not name one)."""
    timeout: float = 300.0
    """Seconds one job may take before it is killed."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.steps < 1 or self.verify_every < 1:
            raise FaultConfigError("nodes, gpus_per_node, steps and verify_every must be >= 1")
        if self.mode not in ("exact", "tolerant"):
            raise FaultConfigError(f"mode must be exact or tolerant, got {self.mode!r}")


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One row of the campaign table."""

    name: str
    """Short id (used by ``--scenarios`` and for file names)."""
    title: str
    """One-line description for the table."""
    fault: Fault | None = None
    """The fault (its rank defaults to the campaign's fault rank); ``None``: a clean run."""
    expect: Expect = "detect"
    """``detect``: at the first check at or after onset; ``undetected``: documented limit;
    ``clean``: no alarm."""
    nodes: int | None = None
    """Override of the campaign's nodes."""
    gpus_per_node: int | None = None
    """Override of the campaign's ranks per node."""
    mode: Literal["exact", "tolerant"] | None = None
    """Override of the guard mode."""
    verify_every: int | None = None
    """Override of the replay period."""
    noise: tuple[NoiseModel, ...] = ()
    """Simulated kernel non-determinism (and per-rank kernel choices), installed on every rank
    with :func:`~replicheck.faults.noise.install_noise`."""
    loss: JobLoss = "lm"
    """The job's loss: plain fp32, bf16 autocast, or padded token mean as a ``LossSum``."""
    checkpointing: Literal["none", "reentrant", "non_reentrant"] = "none"
    """Activation checkpointing of the decoder's blocks."""
    tolerance_floor: float | None = None
    """Override of the guard's tolerant-mode floor (``None``: the guard chooses it from the job's
    precision)."""
    tolerance_ceiling: float | None = None
    """Override of the guard's tolerant-mode ceiling (``None``: chosen by precision)."""
    sketch_block: int | None = None
    """Override of the guard's tolerant-mode sketch block, values per block (``None``: chosen by
    precision)."""
    poison: DataPoison | None = None
    """A sample carrying a non-finite forward (``expect="data"``)."""
    refuse: Refused | None = None
    """Build this refused setup instead of training (``expect="refused"``)."""
    refusal: str = ""
    """Text the refusal message must contain (``expect="refused"``)."""
    parallel: Parallel = "ddp"
    """``ddp``, ``fsdp`` (FSDP2 over every rank) or ``hsdp`` (one replica group per node, sharded
    over the node's ranks)."""
    note: str = ""
    """What the row shows, or why it is expected to be missed."""
    reference: str = ""
    """The published reference figure this row answers, if any."""


def norm_noise() -> tuple[NoiseModel, ...]:
    """The campaign's simulated kernel noise: ~1e-6 relative on the final norm's output of every
    rank (each rank its own generator)."""
    return (KernelNoise(module="norm", rel=1e-6, seed=1),)


def bf16_tolerant() -> dict[str, Any]:
    """Tolerant mode under bf16 autocast with noisy kernels, the sketch block, floor and ceiling
    left to the guard (it chooses them from the job's precision): the fields a :class:`Scenario`
    and a soak's configuration both take, by the same names."""
    return dict(mode="tolerant", loss="lm_bf16", noise=norm_noise())


def tolerance_overrides(floor: float | None, ceiling: float | None, block: int | None) -> dict[str, Any]:
    """The ``GuardConfig`` tolerant-mode fields a run sets; the others keep the guard's defaults."""
    given = (("tolerance_floor", floor), ("tolerance_ceiling", ceiling), ("sketch_block", block))
    return {k: v for k, v in given if v is not None}


_FFN = "blocks.0.ffn"
_WGRAD = "blocks.0.ffn.down.weight"

# Faults more than one row injects (a Fault is frozen, so rows can share one).
_FWD = Fault.at_forward(_FFN).persistent(from_step=23).bitflip(bit=22)
_ZEROED_WGRAD = Fault.at_weight_gradient(_WGRAD).persistent(from_step=23).zero_chunk()
_NAN = Fault.at_forward(_FFN).persistent(from_step=23).nan()
_UPDATE = Fault.at_optimizer_update("blocks.1.attn.qkv.weight").persistent(from_step=23).bitflip(bit=22)
_REDUCED = Fault.at_reduced_gradient().transient(step=23).bitflip(bit=22)
_INF_WGRAD = Fault.at_weight_gradient(_WGRAD).persistent(from_step=23).inf()
_WGRAD_1PCT = Fault.at_weight_gradient(_WGRAD).persistent(from_step=23).scale(1.01, count=8)
_BF16, _ = choose("bf16", sketch_block=None, floor=None, ceiling=None)
"""The tolerances the guard chooses for a bf16 job that sets none (the rows' notes cite them)."""


def _fsdp() -> dict[str, Any]:
    """The FSDP2 rows' layout: 3 nodes × 1 rank, sharded over all three."""
    return dict(parallel="fsdp", nodes=3, gpus_per_node=1)


def default_scenarios() -> list[Scenario]:
    """The matrix ``replicheck campaign`` runs by default."""
    noise = norm_noise()
    bf16 = bf16_tolerant()
    return [
        *(
            Scenario(
                name=f"aws-persistent-{n}n",
                title=f"AWS case: persistent forward fault from step 23, {n} nodes",
                fault=_FWD,
                nodes=n,
                gpus_per_node=1,
                reference="AWS: caught at step 30, steps 23-29 applied (verify every 10)",
            )
            for n in (3, 4)
        ),
        Scenario(
            name="latency-first",
            title="Same fault, latency-first schedule (verify every step)",
            fault=_FWD,
            verify_every=1,
            note="nothing corrupted is applied",
        ),
        Scenario(
            name="wgrad-exact",
            title="Backward-only weight-gradient fault (forward untouched), exact mode",
            fault=_ZEROED_WGRAD,
            mode="exact",
            reference="AWS: no alarm in 50 steps with default kernels",
        ),
        Scenario(
            name="wgrad-tolerant",
            title="Backward-only weight-gradient fault, tolerant mode, noisy kernels",
            fault=_ZEROED_WGRAD,
            mode="tolerant",
            noise=noise,
            note="every rank adds ~1e-6 relative noise (own generator) to the final norm",
            reference="AWS: no alarm in 50 steps with default kernels",
        ),
        Scenario(
            name="optimizer-update",
            title="Optimizer update corrupted from step 23",
            fault=_UPDATE,
        ),
        Scenario(
            name="weights-at-rest",
            title="One bit flipped in stored weights at step 23 (unverified step)",
            fault=Fault.at_weights("blocks.0.ffn.up.weight").transient(step=23).bitflip(bit=22),
            note="replicas then differ, so the weight check sees it",
        ),
        Scenario(
            name="reduced-gradient",
            title="Reduced gradient corrupted after the all-reduce, one-shot at step 23",
            fault=_REDUCED,
            note="per-step check: caught on the step itself",
        ),
        Scenario(
            name="transient-verified",
            title="One-shot forward fault at a verification step (30)",
            fault=Fault.at_forward(_FFN).transient(step=30).bitflip(bit=22),
        ),
        Scenario(
            name="transient-unverified",
            title="One-shot finite forward fault at an unverified step (25)",
            fault=Fault.at_forward(_FFN).transient(step=25).bitflip(bit=22),
            expect="undetected",
            note=(
                "documented limit: the corrupted local gradient is averaged into every replica "
                "identically before any check can compare it; replicas stay bit-identical, so "
                "no later replay or weight check can see it"
            ),
            reference="AWS: one-shot finite fault on an unverified step not caught",
        ),
        Scenario(
            name="nan",
            title="NaN in a forward activation from step 23",
            fault=_NAN,
            note="per-step gradient health check, before the all-reduce",
        ),
        Scenario(
            name="sdc-mix",
            title="Published SDC mix in the block's matmuls from step 23",
            fault=Fault.at_forward(_FFN, ops="matmul").persistent(from_step=23).sdc_mix(),
        ),
        Scenario(
            name="calibration-fault",
            title="Transient probe fault at step 0, during tolerant calibration, noisy kernels",
            fault=dataclasses.replace(
                Fault.at_forward(_FFN).transient(step=0).scale(1.05, count=8), passes=("probe",)
            ),
            mode="tolerant",
            noise=noise,
            note="calibration measures noise replay-to-replay, lower median over ranks",
        ),
        Scenario(
            name="bf16-tolerant-clean",
            title="Clean run, tolerant mode, bf16 autocast, noisy kernels",
            expect="clean",
            **bf16,
            note=(
                "sketch block, floor and ceiling chosen by the guard for bf16 (its start-up log "
                "states them), above the measured bf16 rounding noise (docs/results/soak-bf16.md)"
            ),
        ),
        Scenario(
            name="bf16-wgrad-tolerant",
            title="Backward-only weight-gradient fault (32 values zeroed), bf16 tolerant",
            fault=_ZEROED_WGRAD,
            **bf16,
        ),
        Scenario(
            name="bf16-wgrad-x2",
            title="Backward-only fault x2 on 8 gradient values, bf16 tolerant, per-block sketch",
            fault=Fault.at_weight_gradient(_WGRAD).persistent(from_step=23).scale(2.0, count=8),
            **bf16,
            note="smallest of the measured factors caught at the first verification (docs/results/soak-bf16.md)",
        ),
        Scenario(
            name="bf16-wgrad-1pct-exact",
            title="Backward-only fault x1.01 on 8 gradient values, bf16 autocast, exact mode",
            fault=_WGRAD_1PCT,
            mode="exact",
            loss="lm_bf16",
            note=(
                "exact mode compares bits under deterministic kernels (no simulated kernel noise "
                "here): any change of a gradient value is caught at the first verification"
            ),
        ),
        Scenario(
            name="bf16-wgrad-1pct",
            title="Backward-only fault x1.01 on 8 gradient values, bf16 tolerant, guard's defaults",
            fault=_WGRAD_1PCT,
            expect="undetected",
            **bf16,
            note=(
                "documented limit: for bf16 the guard's start-up log states the smallest change "
                f"tolerant mode catches: {_BF16.smallest_change()}. A 1% change of 8 values is below "
                "that floor: kernel noise moves bf16 gradient values by 1-2 ulps, as much as the "
                "fault does (docs/results/soak-bf16.md). Exact mode catches it: bf16-wgrad-1pct-exact"
            ),
        ),
        Scenario(
            name="token-mean-padded",
            title="Clean run, padded token-mean loss as a LossSum (split probe)",
            expect="clean",
            loss="token_sum",
            note="update equality with the plain loop: tests/distributed/test_update_equality.py",
        ),
        Scenario(
            name="reentrant-checkpointing",
            title="Persistent forward fault, blocks under reentrant activation checkpointing",
            fault=_FWD,
            checkpointing="reentrant",
        ),
        Scenario(
            name="reentrant-checkpointing-clean",
            title="Clean run, blocks under reentrant activation checkpointing",
            expect="clean",
            checkpointing="reentrant",
        ),
        Scenario(
            name="data-borne-inf",
            title="A sample whose forward gives inf on any rank (rank 1's batch, step 23)",
            expect="data",
            poison=DataPoison(step=23, rank=1),
            note=(
                "the sample is re-run on a rank of another node, gives inf there too: classified "
                "data, no node named, and the controller takes no action on it"
            ),
        ),
        Scenario(
            name="syncbn-refused",
            title="Model with SyncBatchNorm (a collective inside forward)",
            expect="refused",
            refuse="sync_batchnorm",
            refusal="SyncBatchNorm",
            note=(
                "refused at construction on every rank, with what to use instead (DDP refuses "
                "SyncBatchNorm on CPU modules itself, so this CPU row adds the layer after wrapping)"
            ),
        ),
        Scenario(
            name="static-graph-refused",
            title="DDP(static_graph=True)",
            expect="refused",
            refuse="static_graph",
            refusal="static_graph",
            note="refused at construction on every rank, with what to use instead",
        ),
        *sharded_scenarios(),
        *fp16_scenarios(),
        Scenario(name="clean", title="Clean run", expect="clean"),
        Scenario(
            name="clean-tolerant",
            title="Clean run, tolerant mode, noisy kernels",
            expect="clean",
            mode="tolerant",
            noise=noise,
        ),
    ]


# The sharded rows' faults by kind, each titled once: FSDP2 and HSDP run the same kinds under
# the same titles, so the two layouts' rows compare line for line.
_SHARDED: dict[str, tuple[str, Fault | None]] = {
    "forward": ("persistent forward fault from step 23", _FWD),
    "wgrad": ("backward-only weight-gradient fault, exact mode", _ZEROED_WGRAD),
    "nan": ("NaN in a forward activation from step 23", _NAN),
    "optimizer-update": ("optimizer update of one shard corrupted from step 23", _UPDATE),
    "reduced-gradient": ("reduced gradient shard corrupted, one-shot at step 23", _REDUCED),
    "clean": ("clean run", None),
}


def _sharded(prefix: str, label: str, notes: dict[str, str], layout: dict[str, Any]) -> list[Scenario]:
    """One row per kind in ``notes`` (kind: the row's note) on one sharded layout, named
    ``<prefix>-<kind>`` and titled ``<label>: <the kind's title>``."""
    rows = []
    for kind, note in notes.items():
        title, fault = _SHARDED[kind]
        expect: Expect = "detect" if fault is not None else "clean"
        rows.append(
            Scenario(
                name=f"{prefix}-{kind}",
                title=f"{label}: {title}",
                fault=fault,
                expect=expect,
                note=note,
                **layout,
            )
        )
    return rows


def sharded_scenarios() -> list[Scenario]:
    """Rows on FSDP2 (3 nodes × 1 rank) and HSDP (3 nodes × 2 ranks: a replica group per node)."""
    fsdp = {
        "forward": "",
        "wgrad": "fingerprints of each layer group's local gradient, taken in the reduce-scatter",
        "nan": "each rank's gradient checked before the reduce-scatter",
        "optimizer-update": (
            "no other rank holds that shard: the ring verifier replays the update, a third "
            "rank arbitrates, and the step's update is undone on every rank"
        ),
        "reduced-gradient": "each reduce-scatter checked against the sum of every rank's input (linear sketches)",
        "clean": "",
    }
    hsdp = {
        "forward": "",
        "optimizer-update": "shards compared across the 3 replica groups: a majority names the rank",
        "reduced-gradient": "per-step check of every reduced shard across replica groups",
        "clean": "",
    }
    return [
        *_sharded("fsdp", "FSDP2", fsdp, _fsdp()),
        *_sharded("hsdp", "HSDP 3×2", hsdp, dict(parallel="hsdp", nodes=3, gpus_per_node=2)),
    ]


def fp16_scenarios() -> list[Scenario]:
    """Rows on fp16 autocast with a dynamic loss scaler (DDP, and one on FSDP2)."""
    return [
        Scenario(
            name="fp16-scaler-clean",
            title="fp16 autocast + GradScaler: clean run (overflow steps skipped)",
            expect="clean",
            loss="lm_fp16",
            note="overflows every rank reproduces are skipped as the scaler skips them, no incident",
        ),
        Scenario(
            name="fp16-scaler-inf",
            title="fp16 + GradScaler: inf in one rank's weight gradient from step 23",
            fault=_INF_WGRAD,
            loss="lm_fp16",
            note="an overflow another rank cannot reproduce is corruption, named",
        ),
        Scenario(
            name="fsdp-fp16-scaler-inf",
            title="FSDP2, fp16 + GradScaler: inf in one rank's weight gradient from step 23",
            fault=_INF_WGRAD,
            loss="lm_fp16",
            note="checked in the reduce-scatter, before the inf reaches every rank's shard",
            **_fsdp(),
        ),
    ]


def fast_scenarios() -> list[Scenario]:
    """A few rows on a tiny job, for the test suite."""
    keep = {"aws-persistent-3n", "reduced-gradient", "transient-unverified", "clean"}
    return [s for s in default_scenarios() if s.name in keep]


def select(scenarios: list[Scenario], names: str | None) -> list[Scenario]:
    """Filter by comma-separated names (a name may end in ``*`` to match a prefix)."""
    if not names:
        return scenarios
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    out = [
        s
        for s in scenarios
        if any(s.name == w or (w.endswith("*") and s.name.startswith(w[:-1])) for w in wanted)
    ]
    unknown = [
        w
        for w in wanted
        if not any(s.name == w or (w.endswith("*") and s.name.startswith(w[:-1])) for s in scenarios)
    ]
    if unknown:
        raise FaultConfigError(f"unknown scenarios {unknown}; known: {[s.name for s in scenarios]}")
    return out
