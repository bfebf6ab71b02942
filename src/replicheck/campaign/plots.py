"""One timeline PNG per scenario (matplotlib is optional: the ``plot`` extra)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def timeline(row: Mapping[str, Any], path: Path) -> Path:
    """Loss per step (mean over ranks, and the faulty rank), verification steps, fault onset,
    detection, and the interval of updates applied while corrupted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses: Mapping[str, list[float | None]] = row.get("losses", {})
    steps = max((len(v) for v in losses.values()), default=0)
    fig, ax = plt.subplots(figsize=(8, 3.4), dpi=100)
    if steps:
        xs = list(range(steps))
        mean = []
        for s in xs:
            vals = [x for v in losses.values() if s < len(v) and (x := v[s]) is not None]
            mean.append(sum(vals) / len(vals) if vals else float("nan"))
        ax.plot(xs, mean, color="tab:blue", lw=1.6, label="loss (mean over ranks)")
        fr = row.get("fault_rank")
        if fr is not None and str(fr) in losses:
            own = [float("nan") if v is None else v for v in losses[str(fr)]]
            ax.plot(xs, own, color="tab:orange", lw=1, ls=":", label=f"loss on faulty rank {fr}")
    for i, s in enumerate(row.get("verified_steps", [])):
        ax.axvline(s, color="tab:green", lw=0.8, alpha=0.5, label="verified (passed)" if i == 0 else None)
    span = row.get("applied_corrupted")
    if span:
        ax.axvspan(span[0] - 0.5, span[1] + 0.5, color="tab:red", alpha=0.12, label="applied while corrupted")
    if row.get("onset") is not None:
        ax.axvline(row["onset"], color="tab:red", ls="--", lw=1.2, label=f"fault onset ({row['onset']})")
    if row.get("detected_at") is not None:
        d = row["detected_at"]
        ax.axvline(d, color="black", lw=1.6, label=f"detected ({d}, {row.get('check')})")
    if row.get("refusal") is not None:
        # Nothing trained: the row is the guard's refusal at construction.
        text = textwrap.fill(f"refused at construction: {row['refusal']}", 110)
        ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=7, transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_xlim(-0.5, max(steps, 1) - 0.5 + (1 if row.get("detected_at") is not None else 0))
    ax.set_title(f"{row['name']}: {row['title']}", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
