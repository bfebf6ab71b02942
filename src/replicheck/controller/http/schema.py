"""The incident's JSON Schema for the OpenAPI description, generated from the Incident
dataclass by pydantic. Documentation only: validation is ``Incident.from_dict``'s."""

from __future__ import annotations

from typing import Any

from replicheck.incident import READABLE_VERSIONS, SCHEMA, SCHEMA_VERSION, Incident


def incident_schema() -> dict[str, Any]:
    """``{"Incident": ..., "Suspect": ..., "NodeIdentity": ...}`` as OpenAPI component schemas."""
    from pydantic import TypeAdapter

    raw = TypeAdapter(Incident).json_schema(ref_template="#/components/schemas/{model}")
    defs = raw.pop("$defs", {})
    props = raw.setdefault("properties", {})
    props["schema"] = {"const": SCHEMA, "type": "string", "description": "always " + SCHEMA}
    props["version"] = {
        "enum": list(READABLE_VERSIONS),
        "type": "integer",
        "description": f"schema version (written: {SCHEMA_VERSION})",
    }
    required = set(raw.get("required", [])) | {"schema", "version", "world_size", "time"}
    raw["required"] = sorted(required)
    raw["description"] = f"A replicheck incident record (version {SCHEMA_VERSION}); see replicheck.incident."
    return {"Incident": raw, **defs}
