"""``gpu.json`` and ``gpu.md``: what ``gpu_check.py`` writes, and the description of that format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "replicheck.gpu_check/1"

PARTS = ("guard_multiprocess", "nccl_smoke", "fingerprint_throughput", "step_ratio")

FORMAT_DOC = """\
## Output format

`benchmarks/gpu_check.py` writes `gpu.json` and this file (`gpu.md`, generated from the JSON) into
`--out` (default `docs/results`). The JSON object:

- `format`: `"replicheck.gpu_check/1"`; `mode`: `"gpu"` or `"tiny"` (CPU, `--tiny`); `ok`: every
  part ran and passed its checks; `seconds`: wall time of the whole run; `started`: UTC time;
  `environment`: torch and CUDA versions, device name, `CUBLAS_WORKSPACE_CONFIG`.
- `parts`: one object per part, each with `ok`, `seconds`, `error` (the traceback, or `null`),
  `checks` (name → `{"ok", "detail"}`) and `result` (the part's figures):
  - `guard_multiprocess`: 3 processes sharing the one device, gloo, the small Llama-style decoder
    (SDPA attention, dropout on the embeddings), exact mode, verify and weights every 4 steps, 10
    steps. Checks `clean_exact_verifications_pass`, `forward_fault_caught` and
    `backward_fault_caught` (a persistent fault on rank 1 from step 5, caught at step 8 by the
    replay with suspect rank 1 and its node), `resume_bit_identical` (a fresh model, optimizer and
    guard in the same processes, restored from the checkpoint store's save after step 4, with the
    CPU and device RNG states saved in the checkpoint's `extra`: the same losses and final weights
    as the uninterrupted run). The four runs share one launch of the 3 processes.
  - `nccl_smoke`: the same guarded loop at world size 1 over NCCL (gloo with `--tiny`), 6 steps,
    verify every 3. Checks `guarded_loop_runs`, `backend`.
  - `fingerprint_throughput`: a float32 tensor (4 GiB; 8 MiB with `--tiny`): milliseconds and
    GB/s of `copy_`, `clone`, `fingerprint.digest`, `digest(fold_zero=True)` and
    `fingerprint.sketch(k=4)` (median of 10, CUDA events); `copy_bandwidth_GBps` counts the bytes
    read and written by `copy_`; each fingerprint's `fraction_of_copy_bandwidth` is its tensor
    GB/s over that (goal ≥ 0.5: reading the tensor once at the speed a copy moves memory is 1.0;
    `null` for the copies themselves); `digest_meets_goal`, `sketch_meets_goal`.
  - `step_ratio`: plain and guarded DDP loops of a 0.94B-parameter Llama-style decoder (d_model
    2048, 16 layers, vocab 32000, 8 × 1024 tokens per step, bf16 autocast, AdamW) interleaved in
    one process at world size 1 over NCCL, exact mode, verify and weights every 10 (the weights
    and optimizer digests the guard skips at world size 1 are added with `check_replicas()`).
    `ratio_of_totals` (headline) over whole 10-step rounds, `median_ratio`, `quartiles`, per-step
    extras, `rounds` run (24 asked, ended early past 150 s: `stopped_early`).
- `syncs_per_step`: device→host synchronisations per guarded step counted with
  `torch.cuda.set_sync_debug_mode("warn")` (rank 0 of the multi-process clean run; the world-size-1
  smoke, with the plain DDP loop's count for comparison; one more verification period of the
  large model after its timed rounds), split into ordinary and verification steps (medians, and
  every step's count); `null` values on the CPU (`--tiny`), where there is nothing to count. The debug mode does
  not instrument `torch.distributed`, so these are the guard's own transfers, a lower bound.

The exit status is 0 when every part passed, 1 when any part failed or ran out of the overall
time budget (`--budget-s`), 2 for a bad command line. Every part runs in its own process, so one
failing part still leaves the others' results.
"""


def write(data: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (out / "gpu.md").write_text(markdown(data), encoding="utf-8")


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    lines = [
        "# GPU check",
        "",
        f"Made with `python benchmarks/gpu_check.py{' --tiny' if data['mode'] == 'tiny' else ''}` on "
        f"{env['device']} (torch {env['torch']}, CUDA {env['cuda']}), {data['started']}, "
        f"{data['seconds']:.0f} s. Overall: **{'passed' if data['ok'] else 'FAILED'}**.",
        "",
        "| part | result | seconds |",
        "|---|---|---|",
    ]
    for name in PARTS:
        p = data["parts"][name]
        lines.append(f"| {name} | {'passed' if p['ok'] else 'FAILED'} | {_fmt(p['seconds'])} |")
    lines.append("")
    for name in PARTS:
        p = data["parts"][name]
        lines += [f"## {name}", ""]
        if p["error"]:
            last = p["error"].strip().splitlines()[-1]
            lines += [f"Error: `{last}` (full traceback in gpu.json)", ""]
        if p["checks"]:
            lines += ["| check | result | detail |", "|---|---|---|"]
            for c, v in p["checks"].items():
                detail = str(v["detail"]).strip().splitlines()[-1] if v["detail"] else ""
                lines.append(f"| {c} | {'passed' if v['ok'] else 'FAILED'} | {detail} |")
            lines.append("")
        r = p["result"]
        if name == "fingerprint_throughput" and r:
            lines += [
                f"{r['tensor']['bytes'] / 2**30:.3g} GiB float32; copy bandwidth {r['copy_bandwidth_GBps']} GB/s "
                "(read + written).",
                "",
                "| op | ms | tensor GB/s | fraction of copy bandwidth |",
                "|---|---|---|---|",
            ]
            for op, v in r["ops"].items():
                frac = v["fraction_of_copy_bandwidth"]
                lines.append(f"| {op} | {v['ms']} | {v['tensor_GBps']} | {'–' if frac is None else frac} |")
            yes = {True: "met", False: "NOT met"}
            lines += [
                "",
                f"Goal (fingerprint GB/s ≥ 0.5 × copy bandwidth): digest {yes[r['digest_meets_goal']]}, "
                f"sketch {yes[r['sketch_meets_goal']]}.",
                "",
            ]
        if name == "step_ratio" and r:
            lines += [
                f"{r['setup']}; {r['parameters']:,} parameters, {r['tokens_per_step']} tokens per "
                f"step, {r['precision']}; {r['guard']}.",
                "",
                "| figure | value |",
                "|---|---|",
                f"| total guarded / total plain ({r['rounds']} rounds of 10 steps) | **{r['ratio_of_totals']}** |",
                f"| median of per-round ratios | {r['median_ratio']} |",
                f"| quartiles | {', '.join(map(str, r['quartiles'])) or 'n/a'} |",
                f"| plain step (median) | {r['plain_step_ms_median']} ms |",
                f"| extra per verification step (median) | {_fmt(r['verification_step_extra_ms_median'])} ms |",
                f"| extra per ordinary step (median) | {_fmt(r['ordinary_step_extra_ms_median'])} ms |",
                "",
            ]
    lines += ["## Device→host synchronisations per step", ""]
    lines += ["| run | ordinary steps | verification steps | plain loop |", "|---|---|---|---|"]
    for run, v in data["syncs_per_step"].items():
        lines.append(
            f"| {run} | {_fmt(v.get('ordinary'))} | {_fmt(v.get('verification'))} | {_fmt(v.get('plain'))} |"
        )
    lines += ["", FORMAT_DOC]
    return "\n".join(lines)
