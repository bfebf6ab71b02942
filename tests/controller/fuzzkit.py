"""A seeded generator of hostile incident files for the ingestion fuzz tests.

Each input comes with the verdict the ingest grammar must reach: ``valid`` inputs (a valid
incident, possibly with harmless oddities such as NaN evidence or Unicode host names) must be
accepted; every other one must be rejected with a reason. The mutations reproduce the
failures found by attacking the controller: deep nesting, lone surrogates, ``:`` and option-like
node names, ranks beyond the world size, NUL bytes, non-ASCII digits, huge numbers, bad JSON.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ctlkit import make_incident

from replicheck.incident import INCIDENT_ID_MAX

HOSTILE_STRINGS = (
    "n1:cordon",
    "-h",
    "--help",
    "node[1-4]",
    "n1,n2",
    "n1 state=idle",
    "a\nb",
    "a\rb",
    "\x1b[31mred",
    "\x00",
    "",
    " ",
    "n\u0661",
    "\u0661\u0662",
    "ü",
    "a" * 300,
    "Comment=replicheck:x",
    "../../etc/passwd",
    "$(reboot)",
    "`id`",
    "\ud800",
    "x\udfff",
    "\u202e",
    "\t",
)


@dataclass(frozen=True)
class Case:
    """One generated input."""

    content: bytes
    valid: bool
    """True when the grammar must accept it."""
    what: str
    """The mutation applied (for failure messages)."""


def _base(rng: random.Random, serial: int) -> dict[str, Any]:
    nodes = tuple(f"node{rng.randrange(64)}" for _ in range(rng.randint(1, 3)))
    nodes = tuple(dict.fromkeys(nodes))
    inc = make_incident(
        job=f"job{serial}",
        step=rng.randrange(1, 10_000),
        nodes=nodes,
        classification=rng.choice(("persistent", "transient", "ambiguous")),
        checkpoint_step=rng.choice((None, 10, 20)),
    )
    data = inc.to_dict()
    data["world_size"] = max(4, len(nodes))
    return data


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        target: Any = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return apply


def _breaking(rng: random.Random, data: dict[str, Any]) -> tuple[str, Callable[[dict[str, Any]], None]]:
    bad = rng.choice(HOSTILE_STRINGS)
    bad_id = bad if ":" not in bad else bad.replace(":", " ")  # ':' (and one '/') are legal in an incident id
    if bad_id.isalnum() and bad_id.isascii():
        bad_id = bad_id * (INCIDENT_ID_MAX // len(bad_id) + 1)  # legal characters: too long is what is bad
    has_suspects = bool(data["suspects"])
    people = "suspects" if has_suspects else "candidates"
    options: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("bad id", _set(("id",), bad_id)),
        ("bad job_id", _set(("job_id",), bad)),
        ("bad suspect_nodes", _set(("suspect_nodes",), [bad])),
        ("bad node name", _set((people, 0, "node", "name"), bad)),
        ("bad slurm_node", _set((people, 0, "node", "slurm_node"), bad)),
        ("rank >= world", _set((people, 0, "rank"), data["world_size"] + rng.randrange(0, 5))),
        ("suspect_rank >= world", _set(("suspect_ranks",), [data["world_size"]])),
        ("negative step", _set(("step",), -rng.randrange(1, 100))),
        ("huge step", _set(("step",), 2**63 + rng.randrange(100))),
        ("float step", _set(("step",), 1.5)),
        ("bool step", _set(("step",), True)),
        ("string step", _set(("step",), "\u0661\u0662")),
        ("zero world", _set(("world_size",), 0)),
        ("unknown check", _set(("check",), bad)),
        ("unknown classification", _set(("classification",), bad)),
        ("bad checks_failed", _set(("checks_failed",), [bad or "x"])),
        ("deep evidence", _set(("evidence",), {"x": _deep(rng.randint(40, 600))})),
        ("surrogate in evidence key", _set(("evidence",), {"\ud800": 1})),
        ("surrogate in hostname", _set((people, 0, "node", "hostname"), "h\udc80")),
        (
            "checkpoint path",
            _set(
                ("recommended_checkpoint",),
                {"step": 1, "path": rng.choice(("-rf", "a\x00b", "a\nb", "", "x\x1b"))},
            ),
        ),
        (
            "checkpoint step",
            _set(("recommended_checkpoint",), {"step": rng.choice(("5", -1, None, 1.0)), "path": "/ck"}),
        ),
        ("naive time", _set(("time",), "2025-01-01T00:00:00")),
        ("future time", _set(("time",), "2999-01-01T00:00:00+00:00")),
        ("time garbage", _set(("time",), bad or "x")),
        (
            "too many nodes",
            lambda d: d.update(
                suspect_nodes=[f"n{i}" for i in range(d["world_size"] + 1 + rng.randrange(800))]
            ),
        ),
        (
            "missing field",
            lambda d: d.pop(
                rng.choice(
                    (
                        "id",
                        "job_id",
                        "step",
                        "check",
                        "classification",
                        "world_size",
                        "time",
                        "schema",
                        "version",
                    )
                )
            ),
        ),
        ("wrong version", _set(("version",), rng.choice((0, 99, "1", None)))),
        ("suspects not list", _set((people,), {"0": 1})),
        ("evidence not object", _set(("evidence",), [1, 2])),
    ]
    return rng.choice(options)


def _harmless(rng: random.Random, data: dict[str, Any]) -> tuple[str, Callable[[dict[str, Any]], None]]:
    people = "suspects" if data["suspects"] else "candidates"
    options: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("unchanged", lambda d: None),
        ("unicode hostname", _set((people, 0, "node", "hostname"), "höst-ü\u202e")),
        ("extra evidence", _set(("evidence",), {"loss": 1.5, "votes": [[1, 2], [3]], "note": "a\nb\x1b"})),
        ("nested evidence", _set(("evidence",), {"x": _deep(rng.randint(1, 25))})),
        ("no checkpoint", _set(("recommended_checkpoint",), None)),
        ("unicode checkpoint path", _set(("recommended_checkpoint",), {"step": 3, "path": "/ckpt/ü/step 3"})),
        ("id with colon", _set(("id",), f"{data['job_id']}:s1:replay")),
    ]
    return rng.choice(options)


def _raw(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    choice = rng.randrange(7)
    if choice == 0:
        return "truncated", text[: rng.randrange(max(1, len(text) - 1))]
    if choice == 1:
        pos = rng.randrange(len(text))
        return "byte flipped to invalid UTF-8", text[:pos] + b"\xff" + text[pos + 1 :]
    if choice == 2:
        return "deep array", b"[" * rng.randint(900, 5000) + b"]" * rng.randint(0, 5000)
    if choice == 3:
        return "deep object", b'{"a":' * rng.randint(900, 3000) + b"1" + b"}" * 3000
    if choice == 4:
        return "not an object", rng.choice((b"[]", b"null", b"1", b'"x"', b"NaN", b""))
    if choice == 5:
        return "lone surrogate escape in id", text.replace(b'"id": "', b'"id": "\\ud800', 1)
    return "random bytes", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))


def generate(seed: int, count: int) -> list[Case]:
    """``count`` inputs, the same for the same seed."""
    rng = random.Random(seed)
    cases = []
    for serial in range(count):
        data = _base(rng, serial)
        kind = rng.random()
        if kind < 0.2:
            what, mutate = _harmless(rng, data)
            mutate(data)
            text = json.dumps(data, indent=rng.choice((None, 2))).encode()
            cases.append(Case(text, True, what))
        elif kind < 0.85:
            what, mutate = _breaking(rng, copy.deepcopy(data))
            mutate(data)
            try:
                text = json.dumps(data).encode("utf-8", "surrogatepass")
            except (RecursionError, ValueError):
                continue
            cases.append(Case(text, False, what))
        else:
            what, raw = _raw(rng, json.dumps(data).encode())
            cases.append(Case(raw, False, what))
    return cases
