"""`/v1/memory/jobs`: the tenant's background jobs (memory extraction), to see what was queued,
what each did, and what failed and why (`dead`: out of attempts). Scope `manage`."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from sqlalchemy import Connection

from policies.public_ids import JOB, PublicIds
from proxy.core.auth import Principal
from proxy.core.errors import BadRequest, Conflict, NotFound
from proxy.core.json_responses import json_response
from proxy.pipeline.turn import now
from proxy.routes.api_types import Job, JobList
from proxy.routes.params import limit_param, page, user_param
from proxy.routes.reference import api
from proxy.state import AppState
from storage.records import JobRecord
from storage.repositories.jobs import STATUSES, Jobs


def job_object(ids: PublicIds, job: JobRecord) -> dict[str, Any]:
    return {
        "id": ids.format(JOB, job.pk),
        "object": "memory.job",
        "kind": job.kind,
        "subject": job.ref,
        "user": job.user_id,
        "status": job.status,
        "attempts": job.attempts,
        "run_after": int(job.run_after.timestamp()),
        "last_error": job.last_error,
        "result": job.result,
        "created_at": int(job.created_at.timestamp()),
        "updated_at": int(job.updated_at.timestamp()),
    }


@get(
    "/v1/memory/jobs",
    summary="List background jobs",
    **api("manage", query=("status", "user", "kind", "subject", "after", "limit"), ok=JobList),
)
async def list_jobs(
    request: Request[Any, Any, Any],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    params = request.query_params
    status = params.get("status")
    if status is not None and status not in STATUSES:
        raise BadRequest(f"'status' must be one of {', '.join(STATUSES)}.", param="status")
    user = params.get("user")
    if user is not None:
        user_param(user)
    user = principal.only(user)
    subject = params.get("subject")
    after = params.get("after")
    after_pk = None if after is None else services.ids.parse(JOB, after)
    if after is not None and after_pk is None:  # (as a conversation's or a memory's cursor)
        raise BadRequest(f"after: no job '{after}'.", param="after")
    limit = limit_param(request)

    def work(conn: Connection) -> list[JobRecord]:
        return Jobs(conn).find(
            principal.tenant_id,
            limit=limit + 1,
            status=status,
            kind=params.get("kind"),
            user_id=user,
            ref=subject,
            after_pk=after_pk,
        )

    found = await services.db.read(work)
    return json_response(page([job_object(services.ids, j) for j in found], limit))


def _not_found(job_id: str) -> NotFound:
    return NotFound(f"No job found with id '{job_id}'.", code="job_not_found", param="job_id")


async def find_job(services: AppState, principal: Principal, job_id: str) -> JobRecord:
    """The tenant's job `job_id`, if the caller sees its user; else a 404."""
    pk = services.ids.parse(JOB, job_id)
    if pk is None:
        raise _not_found(job_id)
    found = await services.db.read(lambda conn: Jobs(conn).get(principal.tenant_id, pk))
    if found is None or not principal.sees(found.user_id):
        raise _not_found(job_id)
    return found


async def retry(services: AppState, principal: Principal, job_id: str) -> JobRecord:
    """A dead job queued again with all its attempts back (404 unknown, 409 not dead)."""
    found = await find_job(services, principal, job_id)
    retried = await services.db.write(
        lambda conn: Jobs(conn).retry(principal.tenant_id, found.pk, now=now())
    )
    if retried is None:
        raise Conflict(
            f"Job '{job_id}' is {found.status}; only a dead job can be retried.",
            param="job_id",
            code="job_not_dead",
        )
    services.jobs.wake()
    return retried


@get("/v1/memory/jobs/{job_id:str}", summary="Get a background job", **api("manage", ok=Job))
async def get_job(
    job_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    return json_response(job_object(services.ids, await find_job(services, principal, job_id)))


@post(
    "/v1/memory/jobs/{job_id:str}/retry",
    summary="Run a dead job again",
    status_code=200,
    **api("manage", ok=Job, errors=(400, 401, 403, 404, 409, 429, 503)),
)
async def retry_job(
    job_id: FromPath[str],
    principal: NamedDependency[Principal],
    services: NamedDependency[AppState],
) -> Response[Any]:
    return json_response(job_object(services.ids, await retry(services, principal, job_id)))


ROUTES = [list_jobs, get_job, retry_job]
