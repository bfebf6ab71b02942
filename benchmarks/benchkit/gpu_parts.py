"""The bodies of ``gpu_check.py``'s parts; each runs inside ``run_single`` (its own process, a
world-size-1 process group: NCCL on a GPU, gloo with ``--tiny``) and returns plain data.

Only what a part cannot get from the public API reaches into the guard: :class:`PairRecorder`
reads the tolerant judge's pair distances and threshold (there is no public hook for them).
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from benchkit.settings import CheckSettings
from replicheck import fingerprint as fp
from replicheck.faults import Fault
from replicheck.guard import CorruptionDetected, Guard, GuardConfig, GuardError, current_pass
from replicheck.harness.workloads import DecoderConfig, lm_loss, lm_loss_bf16, make_model, synthetic_batch

NOT_ON_CPU = "not run on CPU"
"""What a CUDA-only figure reads with ``--tiny``."""

EMBEDDING_INDICES = (3072, 8192)
"""Index counts of the embedding backward: at and above the 3,072 where CUDA changes kernel."""


# -- shared ------------------------------------------------------------------------------------
def device_of(st: CheckSettings) -> torch.device:
    return torch.device("cuda", 0) if st.device == "cuda" else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | str:
    if device.type != "cuda":
        return NOT_ON_CPU
    torch.cuda.synchronize(device)
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def allocated_gib(device: torch.device) -> float | str:
    if device.type != "cuda":
        return NOT_ON_CPU
    return round(torch.cuda.memory_allocated(device) / 2**30, 3)


def batch_on(cfg: DecoderConfig, step: int, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in synthetic_batch(cfg, step=step, rank=0, batch=batch).items()}


def ddp_of(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def has_probe_attention() -> bool:
    """Whether this replicheck has ``GuardConfig.probe_attention`` (the math-backend pin as an option)."""
    return "probe_attention" in GuardConfig.__dataclass_fields__


def _incident(exc: CorruptionDetected) -> dict[str, Any]:
    inc = exc.incident.to_dict()
    return {k: inc.get(k) for k in ("id", "step", "check", "classification", "suspect_ranks", "detail")}


class PairRecorder:
    """Each verification's largest pair distance and the tolerant threshold it was judged by.

    Wraps the judge's replay finding on this instance only (reading the rows' pair distances as
    a column, and the threshold from ``Guard.threshold``); ``available`` is False when the guard
    no longer has it (the part then reports the distances as not observable).
    """

    def __init__(self, guard: Guard) -> None:
        self.rows: list[dict[str, float | None]] = []
        judge = getattr(guard, "_judge", None)
        self.available = hasattr(judge, "_replay_finding") and hasattr(guard, "threshold")
        if not self.available:
            return
        finding_fn = judge._replay_finding  # type: ignore[union-attr]

        def replay_finding(rows: Any, view: Any, replay: Any) -> Any:
            found = finding_fn(rows, view, replay)
            distances = (
                rows.column("pair_distance") if hasattr(rows, "column") else [r.pair_distance for r in rows]
            )
            self.rows.append({"max_distance": max(distances), "threshold": guard.threshold})
            return found

        judge._replay_finding = replay_finding  # type: ignore[union-attr]


# -- a: the NCCL message path at world size 1 ----------------------------------------------------
def exchange_loop(st: CheckSettings, mode: str) -> dict[str, Any]:
    """A DDP guarded loop at world size 1, a verification every step, in ``mode``.

    At world size 1 the guard's exchange loops every message back through pack → the
    communication device → unpack, so received fingerprints sit where NCCL leaves them (the
    device) while the local replay's are on the host: the compare at every step crosses that seam.
    """
    import torch.distributed as dist

    device = device_of(st)
    out: dict[str, Any] = {"mode": mode, "backend": dist.get_backend(), "verified": [], "incident": None}
    out["error"], out["comm_device"], out["pairs"] = None, None, None
    try:
        torch.manual_seed(0)
        model = make_model(st.small, seed=0).to(device)
        ddp = ddp_of(model, device)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        cfg = GuardConfig(verify_every=1, weights_every=1, mode=mode, loss_reduction="sample_mean")  # type: ignore[arg-type]
        guard = Guard(ddp, opt, lm_loss if mode == "exact" else lm_loss_bf16, config=cfg, node="node0")
        out["comm_device"] = str(guard.comm.device)
        pairs = PairRecorder(guard)
        for s in range(st.loop_steps):
            r = guard.step(batch_on(st.small, s, st.small_batch, device))
            if r.verified:
                out["verified"].append(s)
        sync(device)
        out["pairs"] = pairs.rows if pairs.available else None
    except CorruptionDetected as exc:
        out["incident"] = _incident(exc)
    except Exception:  # noqa: BLE001 - the part's evidence
        out["error"] = traceback.format_exc()
    return out


# -- b: replicated training whose reduce-scatter group has one rank ------------------------------
REPLICATED_KINDS = ("replicate", "hsdp_n_by_1", "fsdp_one_gpu")


def _replicated_model(kind: str, cfg: DecoderConfig, device: torch.device, **policy: Any) -> nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(cfg, seed=0).to(device)
    world = dist.get_world_size()
    if kind == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        # One mesh for every unit, as a job would build it (replicate() makes a new one per call).
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("replicate",))
        for block in model.blocks:  # type: ignore[union-attr]  # the decoder's blocks
            replicate(block, mesh=mesh, **policy)
        replicate(model, mesh=mesh, **policy)
        return model
    if kind == "hsdp_n_by_1":
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    elif kind in ("fsdp_one_gpu", "fsdp_offload"):
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def _finite(model: nn.Module) -> bool:
    return all(
        bool(torch.isfinite(p.detach().full_tensor() if hasattr(p, "full_tensor") else p).all())
        for p in model.parameters()
    )


def replicated_nan(st: CheckSettings, kind: str) -> dict[str, Any]:
    """A NaN in one weight gradient at an ordinary step: refused at construction (a typed error
    saying what to do), or an incident at that step; never a silent non-finite update."""
    device = device_of(st)
    out: dict[str, Any] = {"kind": kind, "outcome": None, "refusal": None, "incident": None, "error": None}
    out["params_finite_after"] = None
    try:
        torch.manual_seed(0)
        model = _replicated_model(kind, st.small, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cfg = GuardConfig(verify_every=2, weights_every=2, mode="exact", loss_reduction="sample_mean")
        try:
            guard = Guard(model, opt, lm_loss, config=cfg, node="node0")
        except GuardError as exc:
            out["outcome"], out["refusal"] = "refused", f"{type(exc).__name__}: {exc}"
            return out
        Fault.at_weight_gradient("blocks.0.ffn.down.weight").persistent(from_step=st.nan_step).nan().install(
            model, optimizer=opt, guard=guard
        )
        try:
            for s in range(st.nan_step + 1):
                guard.step(batch_on(st.small, s, st.small_batch, device))
            out["outcome"] = "no incident"
        except CorruptionDetected as exc:
            out["outcome"], out["incident"] = "incident", _incident(exc)
        out["params_finite_after"] = _finite(model)
    except Exception:  # noqa: BLE001
        out["outcome"], out["error"] = "error", traceback.format_exc()
    return out


def offload_verify(st: CheckSettings) -> dict[str, Any]:
    """Single-GPU FSDP2 with ``CPUOffloadPolicy``: exact verifications of a clean run, and where
    the probe passes saw their batch."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    device = device_of(st)
    out: dict[str, Any] = {"outcome": None, "refusal": None, "incident": None, "error": None, "verified": []}
    out["compute_device"] = str(device)
    if device.type != "cuda":
        out["outcome"] = NOT_ON_CPU  # CPUOffloadPolicy needs an accelerator to offload from
        return out
    seen: dict[str, set[str]] = {}

    def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.setdefault(current_pass(), set()).update(str(t.device) for t in batch.values())
        return lm_loss(module, batch)

    try:
        torch.manual_seed(0)
        model = _replicated_model("fsdp_offload", st.small, device, offload_policy=CPUOffloadPolicy())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cfg = GuardConfig(verify_every=1, weights_every=1, mode="exact", loss_reduction="sample_mean")
        try:
            guard = Guard(model, opt, loss_fn, config=cfg, node="node0")
        except GuardError as exc:
            out["outcome"], out["refusal"] = "refused", f"{type(exc).__name__}: {exc}"
            return out
        for s in range(2):
            # The batch starts on the compute device, as a training loop puts it there.
            if guard.step(batch_on(st.small, s, st.small_batch, device)).verified:
                out["verified"].append(s)
        out["outcome"] = "clean"
    except CorruptionDetected as exc:
        out["outcome"], out["incident"] = "incident", _incident(exc)
    except Exception:  # noqa: BLE001
        out["outcome"], out["error"] = "error", traceback.format_exc()
    out["batch_devices_by_pass"] = {k: sorted(v) for k, v in seen.items()}
    return out


# -- c: bitwise reproducibility --------------------------------------------------------------------
def _sdpa_grads(shape: tuple[int, int, int, int], device: torch.device, backend: str) -> list[torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cpu").manual_seed(7)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, g = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    which = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    with sdpa_kernel([which[backend]]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
    return [q.grad, k.grad, v.grad]  # type: ignore[list-item]


def _embedding_grad(rows_width: tuple[int, int], n: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(11)
    rows, width = rows_width
    # Few distinct rows, so that many indices accumulate into each (where order matters).
    idx = torch.randint(0, min(rows, 64), (n,), generator=gen).to(device)
    weight = torch.randn(rows, width, generator=gen).to(device).requires_grad_(True)
    g = torch.randn(n, width, generator=gen).to(device)
    F.embedding(idx, weight).backward(g)
    return [weight.grad]  # type: ignore[list-item]


def _linear_pair(shape: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``linear`` with its weight as a 16-byte-aligned view into a bigger buffer (as a
    received message unpacks it) and with a fresh clone of that weight (as its source allocated it)."""
    gen = torch.Generator(device="cpu").manual_seed(13)
    tokens, n_in, n_out = shape
    x = torch.randn(tokens, n_in, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(n_out, n_in, generator=gen).to(torch.bfloat16)
    buf = torch.zeros(w.numel() + 8, dtype=torch.bfloat16, device=device)
    view = buf[8 : 8 + w.numel()].view(n_out, n_in)  # 8 bf16 = 16 bytes past the allocation
    view.copy_(w.to(device))
    return F.linear(x, view), F.linear(x, view.clone())


REPRO_REPEATS = 3


def reproducibility(st: CheckSettings) -> dict[str, Any]:
    """Digests of 3 repeats of each operation under ``use_deterministic_algorithms(True)``
    (another process computes the same; ``gpu_check`` compares the two)."""
    device = device_of(st)
    cuda = device.type == "cuda"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    ops: dict[str, Callable[[], list[torch.Tensor]] | None] = {
        "sdpa_math_backward": lambda: _sdpa_grads(st.sdpa_shape, device, "math"),
        "sdpa_flash_backward": (lambda: _sdpa_grads(st.sdpa_shape, device, "flash")) if cuda else None,
        "sdpa_efficient_backward": (lambda: _sdpa_grads(st.sdpa_shape, device, "efficient"))
        if cuda
        else None,
    }
    for n in EMBEDDING_INDICES:
        ops[f"embedding_backward_{n}_indices"] = lambda n=n: _embedding_grad(st.embedding, n, device)  # type: ignore[misc]
    out: dict[str, Any] = {}
    for name, fn in ops.items():
        if fn is None:
            out[name] = {"digests": None, "error": NOT_ON_CPU}
            continue
        try:
            digests = [fp.weights_digest(fn()) for _ in range(REPRO_REPEATS)]
            out[name] = {"digests": [f"{d:016x}" for d in digests], "error": None}
        except Exception as exc:  # noqa: BLE001 - e.g. no deterministic kernel: a finding
            out[name] = {"digests": None, "error": f"{type(exc).__name__}: {exc}".strip()[:500]}
    try:
        pairs = [_linear_pair(st.linear, device) for _ in range(REPRO_REPEATS)]
        out["linear_bf16_aligned_view_vs_clone"] = {
            "digests": [f"{fp.weights_digest([a]):016x}" for a, _ in pairs],
            "view_equals_clone": [bool(torch.equal(a, b)) for a, b in pairs],
            "max_abs_difference": max(float((a.float() - b.float()).abs().max()) for a, b in pairs),
            "error": None,
        }
    except Exception as exc:  # noqa: BLE001
        out["linear_bf16_aligned_view_vs_clone"] = {
            "digests": None,
            "error": f"{type(exc).__name__}: {exc}"[:500],
        }
    torch.use_deterministic_algorithms(False)
    return out


# -- d: one exact probe pass, math vs the default attention backends -----------------------------
def probe_pass_memory(st: CheckSettings) -> dict[str, Any]:
    """Peak memory and time of a plain step and of an exact verification step (its probe pass and
    replay), per sequence length and probe attention; bf16 autocast (flash-eligible)."""
    import dataclasses

    device = device_of(st)
    out: dict[str, Any] = {"probe_attention_option": has_probe_attention(), "rows": []}
    for tokens in st.probe_tokens:
        cfg = dataclasses.replace(st.probe_model, seq_len=tokens)
        for attention in ("math", "default"):
            row: dict[str, Any] = {"tokens": tokens, "probe_attention": attention, "error": None}
            out["rows"].append(row)
            if not has_probe_attention():
                row["error"] = "GuardConfig has no probe_attention option in this replicheck"
                continue
            try:
                row.update(_probe_pass_row(cfg, attention, device))
            except Exception as exc:  # noqa: BLE001 - out of memory at 8K with math is a figure
                row["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def _probe_pass_row(cfg: DecoderConfig, attention: str, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device(device):
        model = make_model(cfg, seed=0)
    ddp = ddp_of(model, device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    gcfg = GuardConfig(
        verify_every=2,
        weights_every=1000,
        mode="exact",
        loss_reduction="sample_mean",
        probe_attention=attention,  # type: ignore[call-arg]
    )
    guard = Guard(ddp, opt, lm_loss_bf16, config=gcfg, node="node0")
    b = batch_on(cfg, 0, 1, device)
    row: dict[str, Any] = {"incident": None}
    try:
        guard.step(b)  # step 0: warm-up (a verification)
        guard.step(b)  # step 1: ordinary
        timings = {}
        for _step, name in ((2, "verification_step"), (3, "ordinary_step")):
            reset_peak(device)
            before = allocated_gib(device)
            sync(device)
            t0 = time.perf_counter()
            r = guard.step(b)
            sync(device)
            timings[name] = {
                "verified": r.verified,
                "ms": round((time.perf_counter() - t0) * 1e3, 1),
                "peak_GiB": peak_gib(device),
                "allocated_before_GiB": before,
            }
        row.update(timings)
    except CorruptionDetected as exc:
        row["incident"] = _incident(exc)
    return row


# -- e: fingerprints of a ~1B model's gradient list; the update replay at world size 1 ------------
def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> dict[str, Any]:
    """Host time (the call returning), device time (CUDA events) and kernel launches of ``fn``."""
    fn()  # warm-up
    host, dev = [], []
    for _ in range(repeats):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end) / 1e3)
        sync(device)
    return {
        "host_ms": round(statistics.median(host) * 1e3, 3),
        "device_ms": round(statistics.median(dev) * 1e3, 3) if dev else NOT_ON_CPU,
        "kernel_launches": _launches(fn) if device.type == "cuda" else NOT_ON_CPU,
    }


def _launches(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


class TransferBytes(TorchDispatchMode):
    """Bytes copied between the host and a device, and the devices each guard pass computes on."""

    def __init__(self) -> None:
        super().__init__()
        self.to_host = 0
        self.to_device = 0
        self.copies_to_host = 0
        self.devices_by_pass: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if isinstance(out, torch.Tensor):
            self.devices_by_pass.setdefault(current_pass(), set()).add(str(out.device))
            if src is not None and func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                source = args[1] if func is torch.ops.aten.copy_.default else src
                n = out.numel() * out.element_size()
                if source.device.type != "cpu" and out.device.type == "cpu":
                    self.to_host += n
                    self.copies_to_host += 1
                elif source.device.type == "cpu" and out.device.type != "cpu":
                    self.to_device += n
        return out


def gradient_fingerprints(st: CheckSettings) -> dict[str, Any]:
    """Digest and sketch of the ~1B model's gradient list in fp32 and bf16; then one verification
    step of that model under single-GPU FSDP2 (the update replay's device, bytes, extra memory)."""
    device = device_of(st)
    with torch.device(device):
        model = make_model(st.big, seed=0)
    shapes = [p.shape for p in model.parameters()]
    out: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()), "tensors": len(shapes)}
    del model
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        name = str(dtype).removeprefix("torch.")
        out[name] = {
            "digests": _timed(lambda g=grads: fp.digests(g), device, st.repeats),
            "sketches_k4": _timed(lambda g=grads: fp.sketches(g, seed=1, k=4), device, st.repeats),
        }
        del grads
        gc.collect()
    out["update_replay"] = _update_replay(st, device)
    return out


def _update_replay(st: CheckSettings, device: torch.device) -> dict[str, Any]:
    res: dict[str, Any] = {"setup": "single-GPU FSDP2 (fully_shard per block), AdamW, verify every 2"}
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = _replicated_model("fsdp_one_gpu", st.big, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cfg = GuardConfig(verify_every=2, weights_every=2, mode="tolerant", loss_reduction="sample_mean")
        try:
            guard = Guard(model, opt, lm_loss_bf16, config=cfg, node="node0")
        except GuardError as exc:
            res["refused"] = f"{type(exc).__name__}: {exc}"
            return res
        b = batch_on(st.big, 0, 1, device)
        guard.step(b)
        guard.step(b)
        for _step, name in ((2, "verification_step"), (3, "ordinary_step")):
            reset_peak(device)
            before = allocated_gib(device)
            counter = TransferBytes()
            with counter:
                r = guard.step(b)
            res[name] = {
                "verified": r.verified,
                "peak_GiB": peak_gib(device),
                "allocated_before_GiB": before,
                "host_bytes": counter.to_host,
                "host_copies": counter.copies_to_host,
                "bytes_to_device": counter.to_device,
                "devices_by_pass": {k: sorted(v) for k, v in counter.devices_by_pass.items()},
            }
    except CorruptionDetected as exc:
        res["incident"] = _incident(exc)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    return res


# -- f: overhead as users see it ---------------------------------------------------------------------
def overhead(st: CheckSettings) -> dict[str, Any]:
    """Plain and guarded loops of ``overhead_steps`` back-to-back steps with one synchronisation
    at the end, interleaved; peak memory per loop; then a tolerant bf16 guarded run's pair
    distances against its threshold."""
    device = device_of(st)
    batches = [batch_on(st.big, s, st.big_batch, device) for s in range(OVERHEAD_EVERY)]
    out = _interleaved(st, device, batches)  # its models are freed when it returns
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["tolerant_bf16"] = _tolerant_distances(st, device, batches)
    return out


OVERHEAD_EVERY = 10
"""Verification and weights period of part f's guarded loop."""


def _interleaved(
    st: CheckSettings, device: torch.device, batches: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """The plain and guarded exact loops, interleaved (both models resident throughout)."""
    import torch.distributed as dist

    every = OVERHEAD_EVERY

    def build() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        torch.manual_seed(0)
        with torch.device(device):
            model = make_model(st.big, seed=0)
        ddp = ddp_of(model, device)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    plain, plain_opt = build()
    guarded, guarded_opt = build()
    cfg = GuardConfig(verify_every=every, weights_every=every, mode="exact", loss_reduction="sample_mean")
    guard = Guard(guarded, guarded_opt, lm_loss_bf16, config=cfg, node="node0")

    def plain_step(i: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        lm_loss_bf16(plain, batches[i]).backward()
        plain_opt.step()

    def loop(use_guard: bool) -> tuple[float, float | str]:
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        for i in range(st.overhead_steps):
            if use_guard:
                guard.step(batches[i % every])
            else:
                plain_step(i % every)
        sync(device)
        return time.perf_counter() - t0, peak_gib(device)

    out: dict[str, Any] = {"parameters": sum(p.numel() for p in plain.parameters()), "incident": None}
    out["setup"] = (
        f"world size {dist.get_world_size()}, {dist.get_backend()}, DDP, bf16 autocast, AdamW, "
        f"{st.big_batch} x {st.big.seq_len} tokens a step; guard exact, verify and weights every {every}"
    )
    rounds: list[dict[str, Any]] = []
    try:
        plain_step(0)  # warm-up: DDP's bucket rebuild, allocator, kernel choices
        guard.step(batches[0])
        while guard.next_step % every:
            guard.step(batches[0])
        for _ in range(st.overhead_rounds):
            p_s, p_peak = loop(False)
            g_s, g_peak = loop(True)
            rounds.append(
                {
                    "plain_s": round(p_s, 4),
                    "guarded_s": round(g_s, 4),
                    "plain_peak_GiB": p_peak,
                    "guarded_peak_GiB": g_peak,
                }
            )
    except CorruptionDetected as exc:
        out["incident"] = _incident(exc)
    out["rounds"] = rounds
    if rounds:
        out["ratio_of_totals"] = round(
            sum(r["guarded_s"] for r in rounds) / sum(r["plain_s"] for r in rounds), 4
        )
    return out


def _tolerant_distances(
    st: CheckSettings, device: torch.device, batches: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    res: dict[str, Any] = {"incident": None, "pairs": None, "verify_every": 2}
    torch.manual_seed(0)
    with torch.device(device):
        model = make_model(st.big, seed=0)
    ddp = ddp_of(model, device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    cfg = GuardConfig(verify_every=2, weights_every=2, mode="tolerant", loss_reduction="sample_mean")
    guard = Guard(ddp, opt, lm_loss_bf16, config=cfg, node="node0")
    pairs = PairRecorder(guard)
    try:
        for s in range(st.overhead_steps):
            guard.step(batches[s % len(batches)])
    except CorruptionDetected as exc:
        res["incident"] = _incident(exc)
    if pairs.available:
        res["pairs"] = pairs.rows
        after = pairs.rows[GuardConfig().calibration_verifications :]
        res["largest_distance_after_calibration"] = max((r["max_distance"] for r in after), default=None)
        res["threshold"] = pairs.rows[-1]["threshold"] if pairs.rows else None
    return res


# -- g: the environment -------------------------------------------------------------------------------
def environment(st: CheckSettings) -> dict[str, Any]:
    import os
    import platform
    import subprocess

    cuda = st.device == "cuda"
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "probe_attention_option": has_probe_attention(),
    }
    if not cuda:
        for k in ("driver", "nccl", "capability", "memory_GiB", "tf32", "reduced_precision", "sdpa"):
            env[k] = NOT_ON_CPU
        return env
    props = torch.cuda.get_device_properties(0)
    env["device"] = props.name
    env["capability"] = f"{props.major}.{props.minor}"
    env["memory_GiB"] = round(props.total_memory / 2**30, 1)
    try:
        env["driver"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except Exception as exc:  # noqa: BLE001
        env["driver"] = f"unknown ({type(exc).__name__})"
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    mm = torch.backends.cuda.matmul
    env["tf32"] = {
        "matmul.allow_tf32": mm.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    env["reduced_precision"] = {
        "matmul.allow_bf16_reduced_precision_reduction": mm.allow_bf16_reduced_precision_reduction,
        "matmul.allow_fp16_reduced_precision_reduction": mm.allow_fp16_reduced_precision_reduction,
    }
    b = torch.backends.cuda
    env["sdpa"] = {
        "flash_available": b.is_flash_attention_available(),
        "flash_enabled": b.flash_sdp_enabled(),
        "mem_efficient_enabled": b.mem_efficient_sdp_enabled(),
        "math_enabled": b.math_sdp_enabled(),
        "cudnn_enabled": b.cudnn_sdp_enabled(),
    }
    return env
