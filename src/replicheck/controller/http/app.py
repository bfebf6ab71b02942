"""The controller's HTTP API and approval page (FastAPI). Jobs post incidents with the job
token; operators list, inspect, approve and dismiss with the operator token. Every request
opens its own store connection, so SQLite's write lock (not this process) decides races."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

from replicheck.controller.config import ControllerConfig
from replicheck.controller.controller import Controller
from replicheck.controller.errors import (
    ConfigError,
    ControllerError,
    InvalidTransitionError,
    QuarantinedError,
    UnknownIncidentError,
)
from replicheck.controller.http.auth import (
    Authenticator,
    AuthError,
    Principal,
    RefusalBudget,
    Role,
    Token,
    TokenSource,
)
from replicheck.controller.http.limits import BodyTimeout, Guard, RateLimiter, error_body
from replicheck.controller.http.schema import incident_schema
from replicheck.controller.http.views import detail_json, summary_json
from replicheck.controller.model import State
from replicheck.incident import (
    Incident,
    IncidentFormatError,
    IncidentJSONError,
    load_json,
    validate_incident,
)
from replicheck.timefmt import utc_iso_us

try:
    from fastapi import Body, FastAPI, Query, Request, Security
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, Response
    from fastapi.security import HTTPBearer
    from fastapi.staticfiles import StaticFiles
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the HTTP API needs its extra: pip install 'replicheck[http]'") from exc

log = logging.getLogger("replicheck.http")

API = "/api/v1"
DEFAULT_MAX_BODY = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """How the HTTP server behaves."""

    db_path: str
    """The controller database the API reads and writes."""
    tokens: tuple[Token, ...] = field(repr=False)
    """Accepted job and operator tokens (from the token files)."""
    job_token_path: str | None = None
    """A job token file or directory re-read when it changes (jobs' tokens come and go)."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The controller's policy: its actor name, and the limits the page explains."""
    applies: bool | None = None
    """Whether the acting controller performs cluster actions (None: not known to this server)."""
    max_body_bytes: int = DEFAULT_MAX_BODY
    """Larger request bodies are refused with 413 before they are read."""
    refusal_audits_per_minute: int = 60
    """Refused requests audited one by one per minute; more are counted in the next entry."""
    metrics: bool = True
    """Serve ``/metrics`` (needs prometheus-client)."""
    body_timeout_s: float = 30.0
    """A request body must arrive within this long (else 408)."""
    requests_per_minute: int = 600
    """Requests one credential (a named token, or the shared job or operator token) may make a
    minute, in bursts of half that; more are answered 429 with ``Retry-After``. 0: no limit."""
    incidents_per_day: int = 1000
    """New incidents one job credential may store in 24 hours (a copy of one already stored
    still merges); more are answered 429. 0: no quota."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        if self.body_timeout_s <= 0:
            raise ConfigError("body_timeout_s must be positive")
        for name in ("requests_per_minute", "incidents_per_day"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not any(t.role is Role.OPERATOR for t in self.tokens):
            raise ConfigError("the HTTP API needs an operator token (--operator-token-file)")


class ApiError(Exception):
    """Becomes a JSON error response."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


class DecisionBody(BaseModel):
    """An operator's decision."""

    model_config = ConfigDict(extra="forbid")
    by: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="Who decides. Required with a shared (unnamed) operator token; "
        "with a named token it must be omitted or equal the token's name.",
    )
    expect_state: State | None = Field(
        default=None,
        description="The state the person saw; the decision is refused (409) if the incident "
        "has moved on. Without it, refused if any decision was already recorded.",
    )


def create_app(
    config: HttpConfig,
    *,
    on_change: Callable[[], None] | None = None,
    liveness: Callable[[], dict[str, Any]] | None = None,
) -> Any:
    """The ASGI application (the FastAPI app is its ``.app``). ``on_change`` is called after an
    incident is stored or decided (the serving controller uses it to reconcile at once);
    ``liveness`` says whether the acting loop of this process ran recently (``/healthz``)."""
    sources = () if config.job_token_path is None else (TokenSource(config.job_token_path, Role.JOB),)
    auth = Authenticator(config.tokens, sources)
    budget = RefusalBudget(config.refusal_audits_per_minute)
    limiter = RateLimiter(config.requests_per_minute)
    metrics = None
    if config.metrics:
        from replicheck.controller.http.metrics import ServerMetrics

        metrics = ServerMetrics(config.db_path)
    app = FastAPI(
        title="replicheck controller",
        version="1",
        description="Incidents in, decisions out. Job token: post incidents. Operator token: "
        'everything else. Errors are JSON: {"error": {status, code, message}}.',
        docs_url=None,
        redoc_url=None,
        max_body_size=config.max_body_bytes,
    )
    job_scheme = HTTPBearer(auto_error=False, scheme_name="jobToken", description="the job token")
    operator_scheme = HTTPBearer(
        auto_error=False, scheme_name="operatorToken", description="the operator token"
    )

    @contextlib.contextmanager
    def controller() -> Iterator[Controller]:
        ctl = Controller(config.db_path, config=config.controller)
        try:
            yield ctl
        finally:
            ctl.close()

    def changed() -> None:
        if on_change is not None:
            on_change()

    def refuse(request: Request, err: AuthError) -> None:
        if metrics is not None:
            metrics.refused.labels(str(err.status)).inc()
        audit, dropped = budget.take()
        if not audit:
            return
        client = request.client.host if request.client else "unknown"
        incident_id = request.path_params.get("incident_id")
        outcome = f"{err.status}: {err.message}: {request.method} {request.url.path}"
        if dropped:
            outcome += f" ({dropped} further refusal(s) not audited one by one)"
        with controller() as ctl, ctl.store.transaction():
            if incident_id is not None:
                try:
                    ctl.store.get_record(incident_id)
                except UnknownIncidentError:
                    incident_id = None
            ctl.store.audit(utc_iso_us(), f"http:{client}", "refused request", outcome, incident_id)

    def require(role: Role) -> Callable[..., Principal]:
        scheme = job_scheme if role is Role.JOB else operator_scheme

        def dependency(request: Request, _: Any = Security(scheme)) -> Principal:
            try:
                who = auth.check(request.headers.get("authorization"), role)
            except AuthError as err:
                refuse(request, err)
                raise ApiError(
                    err.status,
                    "unauthorized" if err.status == 401 else "forbidden",
                    err.message,
                    {"WWW-Authenticate": "Bearer"} if err.status == 401 else None,
                ) from None
            wait = limiter.take(_credential(who))
            if wait > 0:
                if metrics is not None:
                    metrics.limited.labels("rate").inc()
                raise ApiError(
                    429,
                    "rate_limited",
                    f"more than {config.requests_per_minute} requests a minute with this token; "
                    f"try again in {wait:.1f} s",
                    {"Retry-After": str(max(1, round(wait + 0.5)))},
                )
            return who

        return dependency

    job = require(Role.JOB)
    operator = require(Role.OPERATOR)

    def bad_body(reason: str) -> None:
        if metrics is not None:
            metrics.bad_bodies.labels(reason).inc()

    # --- errors -----------------------------------------------------------------------------

    def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
        return Response(
            error_body(status, code, message),
            status_code=status,
            media_type="application/json",
            headers=headers,
        )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        bad_body("schema")
        return error(422, "invalid", f"{where or 'request'}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(exc.status_code, "error")
        if exc.status_code == 413:
            bad_body("too_large")
            return error(
                413, code, f"request body larger than {config.max_body_bytes} bytes", {"Connection": "close"}
            )
        return error(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> Response:
        if isinstance(exc, BodyTimeout):
            bad_body("timeout")
            return error(
                408,
                "timeout",
                f"request body not received within {config.body_timeout_s:g} s",
                {"Connection": "close"},
            )
        if isinstance(exc, (sqlite3.OperationalError, OSError)):
            return error(503, "busy", f"database busy, try again: {exc}", {"Retry-After": "1"})
        log.exception("internal error")
        return error(500, "internal", f"internal error: {type(exc).__name__}")

    # --- jobs -------------------------------------------------------------------------------

    @app.post(
        f"{API}/incidents",
        tags=["jobs"],
        status_code=201,
        summary="Report an incident",
        responses={
            200: {"description": "duplicate merged"},
            201: {"description": "stored"},
            400: {"description": "not JSON"},
            401: {"description": "no or unknown token"},
            403: {"description": "not a job token"},
            413: {"description": "body too large"},
            415: {"description": "not application/json"},
            422: {"description": "not a valid incident"},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Incident"}}},
            }
        },
    )
    async def post_incident(request: Request, who: Principal = Security(job)) -> Response:
        """Store an incident (or merge a duplicate: every rank may post the same one). Validated
        with the incident schema; refused bodies store nothing."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            bad_body("content_type")
            raise ApiError(415, "unsupported_media_type", "send the incident as application/json")
        body = await request.body()
        try:
            # The same reader and grammar as incident files (replicheck.incident.load_json):
            # depth, 64-bit integers, duplicate keys, NaN kept as a string.
            data = load_json(body)
        except IncidentJSONError as exc:
            bad_body("malformed")
            raise ApiError(400, "malformed", f"body is not valid JSON: {exc}") from None
        except IncidentFormatError as exc:
            bad_body("schema")
            raise ApiError(422, "invalid_incident", str(exc)) from None
        try:
            incident = Incident.from_dict(data)
            validate_incident(incident)  # the ingest grammar, as for files: refused here, not stored
        except (IncidentFormatError, RecursionError) as exc:
            bad_body("schema")
            raise ApiError(422, "invalid_incident", str(exc)) from None
        if not who.speaks_for(incident.job_id):
            err = AuthError(
                403,
                f"this job token speaks for jobs {','.join(who.jobs or ())}, not for job {incident.job_id}",
            )
            refuse(request, err)
            raise ApiError(403, "forbidden", err.message)
        client = request.client.host if request.client else "unknown"
        owner = f"http:{who.name or 'job'}@"
        source = f"{owner}{client}"

        def store() -> Any:
            with controller() as ctl:
                if config.incidents_per_day and _over_quota(
                    ctl, owner, incident.id, config.incidents_per_day
                ):
                    return None
                return ctl.ingest(incident, source, vouched_by=who.vouches())

        result = await run_in_threadpool(store)
        if result is None:
            if metrics is not None:
                metrics.limited.labels("quota").inc()
            raise ApiError(
                429,
                "quota",
                f"this token stored {config.incidents_per_day} incidents in the last 24 h, its quota; "
                "the incident is not stored (its job keeps it: a fallback file is read as usual)",
                {"Retry-After": "3600"},
            )
        if result.incident_id is None:
            bad_body("schema")
            raise ApiError(422, "invalid_incident", f"not stored: {result.rejected}")
        changed()
        return JSONResponse(
            {"id": result.incident_id, "new": result.new},
            status_code=201 if result.new else 200,
            headers={"Location": f"{API}/incidents/{quote(result.incident_id, safe='')}"},
        )

    # --- operators --------------------------------------------------------------------------

    @app.get(f"{API}/whoami", tags=["operators"], summary="The operator token's identity")
    def whoami(who: Principal = Security(operator)) -> dict[str, Any]:
        return {"role": who.role.value, "name": who.name, "shared": who.name is None}

    @app.get(f"{API}/incidents", tags=["operators"], summary="List incidents")
    def list_incidents(
        state: list[State] | None = Query(default=None, description="only these states"),
        _: Principal = Security(operator),
    ) -> dict[str, Any]:
        with controller() as ctl:
            records = ctl.records(state)
            rejected = ctl.store.count("SELECT COUNT(*) FROM rejected")
            quarantined = [
                {"table": t, "key": k, "reason": r, "at": a} for t, k, r, a in ctl.store.quarantined()
            ]
        return {
            "incidents": [summary_json(r) for r in records],
            "rejected_inputs": rejected,
            "quarantined": quarantined,
        }

    @app.get(
        f"{API}/incidents/{{incident_id:path}}",
        tags=["operators"],
        summary="One incident in full",
        responses={404: {"description": "unknown incident"}},
    )
    def show_incident(incident_id: str, _: Principal = Security(operator)) -> dict[str, Any]:
        with controller() as ctl:
            view = _found(lambda: ctl.show(incident_id))
        return detail_json(view, config.controller, config.applies)

    def decide(
        incident_id: str, decision: str, body: DecisionBody | None, who: Principal, request: Request
    ) -> dict[str, Any]:
        body = body or DecisionBody()
        if who.name is not None:
            if body.by is not None and body.by.strip() != who.name:
                raise ApiError(
                    422,
                    "invalid",
                    f"this operator token belongs to {who.name!r}; omit 'by' or send {who.name!r}",
                )
            name, how = who.name, f"operator token {who.name!r}"
        else:
            if body.by is None or not body.by.strip():
                raise ApiError(422, "invalid", "this is a shared operator token: say who decides in 'by'")
            name, how = body.by.strip(), "shared operator token (name given by the requester)"
        client = request.client.host if request.client else "unknown"
        with controller() as ctl:
            _found(
                lambda: ctl.decide(
                    incident_id,
                    decision,
                    name,
                    expect_state=body.expect_state,
                    via=f"HTTP from {client}, {how}",
                )
            )
            view = ctl.show(incident_id)
        changed()
        return detail_json(view, config.controller, config.applies)

    decision_responses: dict[int | str, dict[str, Any]] = {
        404: {"description": "unknown incident"},
        409: {"description": "not in a state that allows this decision, or already decided"},
        422: {"description": "invalid body"},
    }

    @app.post(
        f"{API}/incidents/{{incident_id:path}}/approve",
        tags=["operators"],
        responses=decision_responses,
        summary="Approve the replacement of the incident's nodes",
    )
    def approve(
        incident_id: str,
        request: Request,
        body: DecisionBody | None = Body(default=None),
        who: Principal = Security(operator),
    ) -> dict[str, Any]:
        return decide(incident_id, "approve", body, who, request)

    @app.post(
        f"{API}/incidents/{{incident_id:path}}/dismiss",
        tags=["operators"],
        responses=decision_responses,
        summary="Dismiss the incident (false alarm: undo the cordon)",
    )
    def dismiss(
        incident_id: str,
        request: Request,
        body: DecisionBody | None = Body(default=None),
        who: Principal = Security(operator),
    ) -> dict[str, Any]:
        return decide(incident_id, "dismiss", body, who, request)

    # --- page, health, metrics --------------------------------------------------------------

    static = resources.files("replicheck.controller.http") / "static"

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        return FileResponse(Path(str(static / "index.html")), headers={"Cache-Control": "no-store"})

    app.mount("/static", StaticFiles(directory=str(static)), name="static")

    @app.get(
        "/healthz",
        tags=["service"],
        summary="Liveness: the database opens and the acting loop ran recently",
        responses={503: {"description": "the database cannot be opened, or the acting loop is stale"}},
    )
    def healthz() -> Response:
        with controller() as ctl:
            schema = ctl.store.schema_version()
            last = ctl.store.get_meta("last_pass_at")
        loop: dict[str, Any] = liveness() if liveness is not None else {"acting": False}
        loop.setdefault("last_pass_at", last)
        if loop.get("last_pass_at") is None:
            loop["last_pass_at"] = last
        ok = bool(loop.get("recent", True))
        return JSONResponse(
            {"ok": ok, "schema_version": schema, "loop": loop}, status_code=200 if ok else 503
        )

    @app.get(
        "/metrics",
        tags=["service"],
        summary="Prometheus metrics (text format)",
        responses={200: {"content": {"text/plain": {}}}, 501: {"description": "prometheus-client missing"}},
    )
    def get_metrics() -> Response:
        if metrics is None:
            raise ApiError(501, "not_enabled", "metrics are off (pip install 'replicheck[metrics]')")
        data, ctype = metrics.exposition()
        return Response(data, media_type=ctype)

    original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(incident_schema())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def on_response(method: str, route: str, status: int) -> None:
        if metrics is not None:
            metrics.requests.labels(method, route, str(status)).inc()

    # Outermost, so an announced oversized body is refused before any other layer reads it.
    return Guard(
        app,
        limit=config.max_body_bytes,
        on_response=on_response,
        on_too_large=lambda: bad_body("too_large"),
        body_timeout_s=config.body_timeout_s,
    )


def _credential(who: Principal) -> str:
    """What a rate limit is kept per: the token's name, or the role's shared token."""
    return f"{who.role.value}:{who.name}" if who.name is not None else f"{who.role.value}:shared"


def _over_quota(ctl: Controller, owner: str, incident_id: str, quota: int) -> bool:
    """True when ``owner`` (a source prefix) stored ``quota`` new incidents in 24 h and this
    one would be new (a copy of a stored incident merges and costs nothing)."""
    since = utc_iso_us(datetime.now(UTC) - timedelta(days=1))
    # A range on the (source, first_seen) index: "http:NAME@" .. "http:NAME@\U0010ffff".
    stored = ctl.store.count(
        "SELECT COUNT(*) FROM incidents WHERE source >= ? AND source < ? AND first_seen >= ?",
        (owner, owner + "\U0010ffff", since),
    )
    if stored < quota:
        return False
    return ctl.store.count("SELECT COUNT(*) FROM incidents WHERE id=?", (incident_id,)) == 0


def _found(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except UnknownIncidentError as exc:
        raise ApiError(404, "not_found", str(exc)) from None
    except InvalidTransitionError as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    except ConfigError as exc:
        raise ApiError(422, "invalid", str(exc)) from None
    except QuarantinedError as exc:
        raise ApiError(409, "quarantined", str(exc)) from None
    except ControllerError as exc:
        raise ApiError(503, "unavailable", str(exc)) from None
