"""The inspector's pages on work and spend: background jobs (dead letters retried from here)
and usage, per day and model as server-drawn charts and per user as a table."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.response import Redirect, Template
from sqlalchemy import Connection

from policies.public_ids import JOB
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest
from proxy.pipeline.turn import now
from proxy.routes.jobs import job_object, retry
from proxy.state import AppState
from proxy.ui.chart import bar_chart
from proxy.ui.pages import PAGE, context
from storage.records import JobRecord, UsageTotals
from storage.repositories.exchanges import Exchanges, GroupBy
from storage.repositories.jobs import STATUSES, Jobs

MAX_DAYS = 366


@get("/jobs")
async def jobs_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    status = request.query_params.get("status") or None
    if status is not None and status not in STATUSES:
        raise BadRequest(f"'status' must be one of {', '.join(STATUSES)}.", param="status")
    after = request.query_params.get("after")
    after_pk = services.ids.parse(JOB, after) if after else None

    def work(conn: Connection) -> list[JobRecord]:
        return Jobs(conn).find(
            principal.tenant_id,
            limit=PAGE + 1,
            status=status,
            user_id=principal.user,
            after_pk=after_pk,
        )

    found = [job_object(services.ids, j) for j in await services.db.read(work)]
    retried = request.query_params.get("retried")
    return Template(
        "jobs.html",
        context=context(
            principal,
            "Background jobs",
            jobs=[_shown(j) for j in found[:PAGE]],
            status=status,
            statuses=STATUSES,
            next_after=found[PAGE - 1]["id"] if len(found) > PAGE else None,
            notice=f"Job {retried} queued again." if retried else None,
        ),
    )


def _shown(job: dict[str, Any]) -> dict[str, Any]:
    """The API's job object, its time as a datetime (the API's carry Unix seconds)."""
    return {**job, "updated_at": datetime.fromtimestamp(job["updated_at"], UTC)}


@post("/jobs/retry", status_code=303)
async def retry_job(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Redirect:
    form = await request.form()
    job = await retry(services, principal, str(form.get("id") or ""))
    job_id = services.ids.format(JOB, job.pk)
    return Redirect(f"/ui/jobs?retried={job_id}", status_code=303)


def _spend(row: UsageTotals) -> float:
    return row.cost_upstream_usd + row.cost_memory_usd


def _tokens(row: UsageTotals) -> int:
    return row.prompt_tokens + row.completion_tokens


def _totals(rows: list[UsageTotals]) -> dict[str, Any]:
    return {
        "requests": sum(r.requests for r in rows),
        "tokens": sum(_tokens(r) for r in rows),
        "cost": sum(_spend(r) for r in rows),
        "unpriced": sum(r.unpriced_requests for r in rows),
    }


@get("/usage")
async def usage_page(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Template:
    raw = request.query_params.get("days") or "30"
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_DAYS:
        raise BadRequest(f"'days' must be a whole number from 1 to {MAX_DAYS}.", param="days")
    days = int(raw)
    end = now()
    start = end - timedelta(days=days)
    await services.deferred.settle()  # (mode-off records are written in batches)
    groups: tuple[GroupBy, ...] = ("day", "model") if principal.user else ("day", "model", "user")

    def work(conn: Connection) -> dict[str, list[UsageTotals]]:
        repo = Exchanges(conn)
        return {g: repo.usage(principal.tenant_id, start, end, g, principal.user) for g in groups}

    by = await services.db.read(work)
    per_day = {r.key: r for r in by["day"]}
    calendar = [(start + timedelta(days=i)).date().isoformat() for i in range(days + 1)]
    spend = [(d, _spend(per_day[d]) if d in per_day else 0.0) for d in calendar]
    tokens = [(d, float(_tokens(per_day[d])) if d in per_day else 0.0) for d in calendar]
    models = [r.key or "(none)" for r in by["model"]]
    return Template(
        "usage.html",
        context=context(
            principal,
            "Usage",
            days=days,
            start=start,
            end=end,
            only_user=principal.user,
            total=_totals(by["day"]),
            spend_chart=bar_chart("Spend per day (USD)", spend, unit=" USD", digits=6),
            tokens_chart=bar_chart("Tokens per day", tokens, unit=" tokens"),
            model_charts=[
                bar_chart(
                    "Spend per model (USD)",
                    [(m, _spend(r)) for m, r in zip(models, by["model"], strict=True)],
                    unit=" USD",
                    digits=6,
                ),
                bar_chart(
                    "Tokens per model",
                    [(m, float(_tokens(r))) for m, r in zip(models, by["model"], strict=True)],
                    unit=" tokens",
                ),
            ],
            tables=[{"name": g, "rows": by[g]} for g in groups if g != "day"],
        ),
    )


ROUTES = [jobs_page, retry_job, usage_page]
