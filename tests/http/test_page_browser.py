"""The approval page in a real headless Chromium (Debian's package, driven by Playwright):
load it, see the pending incident, approve it with the token, see the state change and the
audit entry. A screenshot is kept under the test's tmp path (REPLICHECK_DOCS_SCREENSHOT=PATH
also writes it there, which is how docs/http-approval-page.png is made)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from httpkit import ALICE_TOKEN, JOB_TOKEN, Live, call, make_incident

from replicheck.controller import LocalBackend, State

pytestmark = pytest.mark.timeout(180)

CHROMIUM = os.environ.get("REPLICHECK_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]


def _need_browser() -> Any:
    """Playwright's sync API, or a skip outside CI (in CI a missing browser is a failure)."""
    problems = []
    if not Path(CHROMIUM).exists():
        problems.append(f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/system-deps.sh)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problems.append("playwright is not installed (pip install -e '.[test]')")
    if problems:
        if os.environ.get("CI"):
            pytest.fail("; ".join(problems))
        pytest.skip("; ".join(problems))
    return sync_playwright


@pytest.fixture
def page() -> Iterator[Any]:
    sync_playwright = _need_browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=60_000)
        try:
            context = browser.new_context(viewport={"width": 1200, "height": 1500})
            pg = context.new_page()
            pg.set_default_timeout(20_000)
            yield pg
        finally:
            browser.close()


def test_approve_from_the_page(live: Live, page: Any, tmp_path: Path) -> None:
    """An on-call engineer approves a pending incident in Chromium; the page shows the new state
    and the audit entry naming them, and the store agrees."""
    inc = make_incident(job="train-42", nodes=("n2",))
    assert call(live.url, "POST", "/api/v1/incidents", inc.to_json(), token=JOB_TOKEN).status == 201
    LocalBackend(live.db).set_healthy("n2", False)  # the simulated bad node fails its self-test
    with live.controller(triage_persistent=True) as ctl:
        ctl.reconcile()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

    page.goto(live.url + "/")
    page.fill("#token", ALICE_TOKEN)
    page.click("#signin button[type=submit]")
    page.wait_for_selector("#identity:has-text('signed in as alice')")
    link = page.locator(f"#list a[data-incident='{inc.id}']")
    link.wait_for()
    assert "Needs a decision (1)" in page.inner_text("#list")
    link.click()
    page.wait_for_selector("#decision:not([hidden])")
    assert page.inner_text("#state") == "awaiting_approval"
    assert "n2" in page.inner_text("#approve-text") and "checkpoint step 30" in page.inner_text(
        "#approve-text"
    )
    assert "DISAGREE" in page.inner_text("#pairs")
    assert "FAILED" in page.inner_text("#triage")
    assert "n2.cluster" in page.inner_text("#suspects")
    assert page.locator("#timeline circle").count() >= 3
    shot = tmp_path / "approval-page-pending.png"
    page.screenshot(path=str(shot), full_page=True)

    page.click("#approve")
    page.wait_for_selector("#confirm-row:not([hidden])")
    assert page.inner_text("#confirm") == "Yes, replace n2"
    page.click("#confirm")
    page.wait_for_selector("#state:has-text('approved')")
    page.wait_for_selector("#message:has-text('Approved')")
    audit = page.inner_text("#audit")
    assert "approve requested" in audit and "alice" in audit and "awaiting_approval -> approved" in audit
    assert page.locator("#decision").is_hidden()
    page.screenshot(path=str(tmp_path / "approval-page-approved.png"), full_page=True)
    assert shot.stat().st_size > 10_000
    target = os.environ.get("REPLICHECK_DOCS_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)
    with live.controller() as ctl:
        record = ctl.store.get_record(inc.id)
    assert record.state is State.APPROVED and record.approved_by == "alice"
    assert errors == []


def test_dismiss_with_shared_token_and_refused_token(live: Live, page: Any) -> None:
    """A wrong token is refused on the page; a shared token asks for a name, and the dismissal
    is recorded under it."""
    inc = make_incident(job="train-7")
    call(live.url, "POST", "/api/v1/incidents", inc.to_json(), token=JOB_TOKEN)
    with live.controller() as ctl:
        ctl.reconcile()
    page.goto(live.url + "/")
    page.fill("#token", "definitely-not-the-token-123")
    page.click("#signin button[type=submit]")
    page.wait_for_selector("#message:has-text('Token refused')")
    from httpkit import SHARED_TOKEN

    page.fill("#token", SHARED_TOKEN)
    page.click("#signin button[type=submit]")
    page.wait_for_selector("#who-label:not([hidden])")
    page.fill("#who", "bob")
    page.click(f"#list a[data-incident='{inc.id}']")
    page.wait_for_selector("#decision:not([hidden])")
    page.click("#dismiss")
    page.click("#confirm")
    page.wait_for_selector("#state:has-text('dismissed')")
    assert "dismiss requested" in page.inner_text("#audit")
    with live.controller() as ctl:
        assert ctl.store.get_record(inc.id).dismissed_by == "bob"


def test_detail_view_reset_for_odd_evidence(live: Live, page: Any) -> None:
    """Opening an incident whose evidence has `null` pairs after a normal one never leaves the
    first incident's tables (or its Approve button) under the second heading; evidence that looks
    like markup is shown as text. On the old code the drawing stopped half way at the null pair."""
    first = make_incident(job="job1")
    odd = dataclasses.replace(
        make_incident(job="job2"),
        evidence={"replay": {"pairs": [None, {"source": "<img src=x onerror=alert(1)>", "agree": False}]}},
    )
    for inc in (first, odd):
        assert call(live.url, "POST", "/api/v1/incidents", inc.to_json(), token=JOB_TOKEN).status == 201
    with live.controller() as ctl:
        ctl.reconcile()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(live.url + "/")
    page.fill("#token", ALICE_TOKEN)
    page.click("#signin button[type=submit]")
    page.locator(f"#list a[data-incident='{first.id}']").click()
    page.wait_for_selector(f"#incident-id:has-text('{first.id}')")
    assert "n3" in page.inner_text("#pairs")  # the first incident's verifier node
    page.locator(f"#list a[data-incident='{odd.id}']").click()
    page.wait_for_selector(f"#incident-id:has-text('{odd.id}')")
    page.wait_for_selector("#decision:not([hidden])")
    pairs = page.inner_text("#pairs")
    assert "n3" not in pairs and "<img src=x onerror=alert(1)>" in pairs
    assert page.locator("#pairs img").count() == 0
    assert errors == []


def test_refused_incident_is_listed_with_its_reason(live: Live, page: Any) -> None:
    """An incident naming a node outside its job's allocation is listed under "Refused" (not
    hidden from the page), and its detail says nothing was done and why, without a decision."""
    LocalBackend(live.db).add_job("evil", ("n1",))
    inc = make_incident(job="evil", nodes=("n2",))
    assert call(live.url, "POST", "/api/v1/incidents", inc.to_json(), token=JOB_TOKEN).status == 201
    with live.controller() as ctl:
        ctl.reconcile()
        assert ctl.store.get_record(inc.id).state is State.REFUSED
    page.goto(live.url + "/")
    page.fill("#token", ALICE_TOKEN)
    page.click("#signin button[type=submit]")
    group = page.wait_for_selector(".group:has(a[data-incident='evil-s40-replay'])")
    assert group.inner_text().startswith("Refused: not the job's own nodes")
    page.click(f"#list a[data-incident='{inc.id}']")
    page.wait_for_selector("#state:has-text('refused')")
    status = page.inner_text("#status-line")
    assert status.startswith("Refused: nothing was done") and "not in job evil's allocation" in status
    assert page.is_hidden("#decision")
