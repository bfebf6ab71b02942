"""``gpu.json`` and ``gpu.md``: what ``gpu_check.py`` writes, and the description of that format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchkit.judge import gib

FORMAT = "replicheck.gpu_check/2"

PARTS = (
    "exchange_exact",
    "exchange_tolerant",
    "replicated_nan",
    "fsdp_cpu_offload",
    "reproducibility",
    "probe_pass_memory",
    "gradient_fingerprints",
    "overhead",
    "environment",
)

CAUGHT = {
    "exchange_exact": "1: received fingerprints on the device, the local replay's on the host — the first compare raises",
    "exchange_tolerant": "1: the same in tolerant mode (sketch distance across devices)",
    "replicated_nan": "5: a NaN gradient applied with no incident under replicate() / (N, 1) HSDP / one-GPU FSDP2",
    "fsdp_cpu_offload": "8: the guard's device becomes the host, the probe batch goes there while logits are on the GPU",
    "reproducibility": "4, 10: whether flash / memory-efficient backward may replace the math pin; aligned views vs clones",
    "probe_pass_memory": "4: no probe_attention option — the probe's attention matrix at 8K tokens, with no alternative",
    "gradient_fingerprints": "3: the update replay's host bytes, copies and extra memory (figures, not a pass/fail)",
    "overhead": "figures users see; a false alarm in exact or tolerant bf16 fails it",
    "environment": "context for every figure (not judged)",
}
"""What each part would have caught on d3f1fc3 (the issue's findings), shown in gpu.md."""

FORMAT_DOC = """\
## Output format

`benchmarks/gpu_check.py` writes `gpu.json` and this file (`gpu.md`, generated from the JSON) into
`--out` (default `docs/results`). Every part runs in its own process (part b: one per case; part
c: two), at world size 1 (NCCL bound to `cuda:0`; gloo with `--tiny`), with its own time box cut
to what is left of the overall budget (`--budget-s`, default 300 s on a GPU: the whole check fits
in 5 minutes on one H200, leaving room to run it again within 15 minutes of device time). Parts
run most valuable first; a part that no longer fits is `skipped`. The JSON object:

- `format`: `"replicheck.gpu_check/2"`; `mode`: `"gpu"` or `"tiny"` (CPU, `--tiny`); `ok`: every
  part ran and passed its judged checks; `seconds`, `budget_s`, `started` (UTC);
  `environment`: part g's result (also under `parts`).
- `parts`: one object per part, each with `status` (`passed`, `failed`, `skipped`), `seconds`,
  `error` (a traceback, the reason it was skipped, or `null`), `checks` (name →
  `{"ok", "judged", "detail"}`; a check with `judged: false` records a finding and never fails
  the part) and `result` (the part's figures). CUDA-only figures read `"not run on CPU"` with
  `--tiny`.
  - a. `exchange_exact`, `exchange_tolerant`: a DDP guarded loop on the small decoder (bf16
    autocast in tolerant mode), verify and weights every step, 6 steps (3 with `--tiny`).
    Checks `guarded_loop_verifies_every_step`, `backend`; `pair_distances` (recorded).
  - b. `replicated_nan`: one check per case — `replicate` (`replicate_with_fsdp.replicate` per
    block and the root), `hsdp_n_by_1` (`fully_shard` on a (1, 1) replicate × shard mesh),
    `fsdp_one_gpu` — with a NaN in `blocks.0.ffn.down.weight`'s gradient from step 3 (an
    ordinary step; verify every 2): passed if refused at construction with a typed `GuardError`
    (its message in the detail) or an incident at step 3; failed on no incident (the detail says
    whether the weights went non-finite) or any other error. `fsdp_cpu_offload`: single-GPU FSDP2
    with `CPUOffloadPolicy`, exact, verify every step: `clean_exact_verification` and
    `probe_batch_on_compute_device` (the devices of the batch the loss function saw in `probe`
    and `replay` passes); not judged when single-GPU FSDP2 is refused.
  - c. `reproducibility`: under `torch.use_deterministic_algorithms(True)`, digests of 3 repeats in
    each of two processes: SDPA math, flash and memory-efficient backward (bf16, causal; flash
    and memory-efficient not run on CPU), embedding backward with 3,072 and 8,192 indices, bf16
    `linear` with its weight a 16-byte-aligned view into a bigger buffer vs a clone.
    `result.operations`: per operation `in_process`, `across_processes` (and for the linear
    `view_equals_clone`, `max_abs_difference`). Judged: math attention and the embeddings (the
    exact probe relies on them today); the rest are findings.
  - d. `probe_pass_memory`: a 4-layer decoder (d_model 1024, 16 heads, vocab 32000), one
    sequence of 4,096 and of 8,192 tokens, bf16 autocast, exact mode, for
    `GuardConfig(probe_attention="math")` and `"default"`: milliseconds and peak GiB of a
    verification step (training pass, probe pass, replay) and of an ordinary step. Judged: the
    option exists, every row ran, no false alarm.
  - e. `gradient_fingerprints`: the 0.94B-parameter decoder's gradient list (random, fp32 and
    bf16): `fingerprint.digests` and `fingerprint.sketches(k=4)`: `host_ms` (until the call
    returns), `device_ms` (CUDA events), `kernel_launches` (`torch.profiler`). `update_replay`:
    the same model under single-GPU FSDP2 (tolerant, AdamW, verify every 2): for a verification
    and an ordinary step, `host_bytes` and `host_copies` (device→host copies seen by a dispatch
    mode), `bytes_to_device`, `peak_GiB`, `allocated_before_GiB` and the devices each guard pass
    computed on (`devices_by_pass`). Judged: it ran without error or false alarm (not judged
    when refused).
  - f. `overhead`: plain and guarded DDP loops of the 0.94B model (4 × 1024 tokens a step, bf16
    autocast, AdamW; exact, verify and weights every 10), each loop 20 back-to-back steps with one
    synchronisation at the end, interleaved for 3 rounds: per round `plain_s`, `guarded_s`,
    peak GiB of each loop (both models resident: the difference is the guard's), and
    `ratio_of_totals`. Then a tolerant bf16 guarded run (20 steps,
    verify every 2): `pairs` (each verification's largest pair distance and threshold),
    `largest_distance_after_calibration`, `threshold`. Judged: no false alarm; the largest
    distance at or under the threshold.
  - g. `environment`: torch, Python, CUDA, driver, NCCL, device, compute capability, memory,
    `CUBLAS_WORKSPACE_CONFIG`, TF32 and reduced-precision flags, SDPA backends available and
    enabled, whether `GuardConfig.probe_attention` exists.

The exit status is 0 when every part passed, 1 when a judged check failed or a part failed or
was skipped, 2 for a bad command line.
"""


def write(data: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "gpu.md").write_text(markdown(data), encoding="utf-8")


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _cell(text: Any) -> str:
    lines = str(text).strip().splitlines()
    return (lines[-1] if lines else "").replace("|", "\\|")


def _status(s: str) -> str:
    return {"passed": "passed", "failed": "**FAILED**", "skipped": "skipped"}.get(s, s)


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"] or {}
    made = "python benchmarks/gpu_check.py" + (" --tiny" if data["mode"] == "tiny" else "")
    lines = [
        "# GPU check",
        "",
        f"Made with `{made}` on {env.get('device', 'n/a')} (torch {env.get('torch', 'n/a')}, CUDA "
        f"{env.get('cuda')}, NCCL {env.get('nccl', 'n/a')}, driver {env.get('driver', 'n/a')}), "
        f"{data['started']}, {data['seconds']:.0f} s of a {data['budget_s']:.0f} s budget. "
        f"Overall: **{'passed' if data['ok'] else 'FAILED'}**.",
        "",
        "| part | result | seconds | would have caught on d3f1fc3 |",
        "|---|---|---|---|",
    ]
    for name in PARTS:
        p = data["parts"][name]
        lines.append(f"| {name} | {_status(p['status'])} | {_fmt(p['seconds'])} | {CAUGHT[name]} |")
    lines.append("")
    for name in PARTS:
        p = data["parts"][name]
        lines += [f"## {name}", ""]
        if p["error"]:
            lines += [f"Error: `{_cell(p['error'])}` (full text in gpu.json)", ""]
        if p["checks"]:
            lines += ["| check | result | detail |", "|---|---|---|"]
            for c, v in p["checks"].items():
                res = ("passed" if v["ok"] else "**FAILED**") if v["judged"] else "recorded"
                lines.append(f"| {c} | {res} | {_cell(v['detail'])} |")
            lines.append("")
        r = p["result"]
        if not r:
            continue
        if name == "reproducibility":
            lines += ["| operation | 3 repeats identical | across processes | note |", "|---|---|---|---|"]
            for op, v in r["operations"].items():
                note = v.get("note") or (
                    f"view equals clone: {v['view_equals_clone']}" if "view_equals_clone" in v else ""
                )
                lines.append(
                    f"| {op} | {_fmt(v['in_process'])} | {_fmt(v['across_processes'])} | {_cell(note)} |"
                )
            lines.append("")
        if name == "gradient_fingerprints":
            lines += [
                f"{r['parameters']:,} parameters in {r['tensors']} tensors.",
                "",
                "| dtype | op | host ms | device ms | kernel launches |",
                "|---|---|---|---|---|",
            ]
            for dtype in ("float32", "bfloat16"):
                for op, v in r[dtype].items():
                    lines.append(
                        f"| {dtype} | {op} | {v['host_ms']} | {v['device_ms']} | {v['kernel_launches']} |"
                    )
            lines += ["", f"Update replay ({r['update_replay']['setup']}):", ""]
            lines += ["```", json.dumps(r["update_replay"], indent=1, default=str), "```", ""]
        if name == "overhead":
            lines += [f"{r['setup']}; {r['parameters']:,} parameters.", ""]
            lines += [
                "| round | plain s | guarded s | plain peak GiB | guarded peak GiB |",
                "|---|---|---|---|---|",
            ]
            for i, row in enumerate(r["rounds"]):
                lines.append(
                    f"| {i} | {row['plain_s']} | {row['guarded_s']} | {row['plain_peak_GiB']} | {row['guarded_peak_GiB']} |"
                )
            tol = r["tolerant_bf16"]
            lines += [
                "",
                f"Guarded / plain over all rounds: **{_fmt(r.get('ratio_of_totals'))}**. Tolerant bf16: largest "
                f"pair distance after calibration {_fmt(tol.get('largest_distance_after_calibration'))}, "
                f"threshold {_fmt(tol.get('threshold'))}.",
                "",
            ]
        if name == "probe_pass_memory":
            lines += ["| tokens | probe attention | verification step | ordinary step |", "|---|---|---|---|"]
            for row in r["rows"]:
                if row.get("error") or row.get("incident"):
                    lines.append(
                        f"| {row['tokens']} | {row['probe_attention']} | {_cell(row.get('error') or 'incident')} | |"
                    )
                    continue
                v, o = row["verification_step"], row["ordinary_step"]
                lines.append(
                    f"| {row['tokens']} | {row['probe_attention']} | {v['ms']} ms, {gib(v['peak_GiB'])} | "
                    f"{o['ms']} ms, {gib(o['peak_GiB'])} |"
                )
            lines.append("")
        if name == "environment":
            lines += ["```", json.dumps(r, indent=1, default=str), "```", ""]
    lines += [FORMAT_DOC]
    return "\n".join(lines)
