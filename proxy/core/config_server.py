"""`server` and `database`: the process's own settings, as against each tenant's.

Part of the configuration's models (`proxy.core.config`), kept apart for its length.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError


class _Strict(BaseModel):  # (as proxy.core.config_identity's)
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    max_body_bytes: int = Field(8_000_000, gt=0)
    # Messages in one request (a chat completion's `messages`, a Responses `input` array, a
    # management import), at most: each is a stored row, and a request of 200,000 tiny ones
    # fits the body limit. More is a 413 naming this key.
    max_request_messages: int = Field(10_000, ge=1)
    # A request body whose next part does not arrive within this long is answered 408 (as
    # nginx's client_body_timeout), rather than holding its connection for as long as it likes.
    body_timeout_seconds: float = Field(60.0, gt=0)
    # A request whose headers are not whole within this long has its connection closed (408),
    # as nginx's client_header_timeout (`memproxy serve`: proxy/core/slow_headers.py).
    header_timeout_seconds: float = Field(10.0, gt=0)
    cors_origins: list[str] = []
    # How often each replica writes its limit counts and reads the shared totals (see limits).
    limits_sync_seconds: float = Field(1.0, gt=0)
    # When set, GET /metrics wants `Authorization: Bearer <metrics_key>` (it names tenants and
    # the models their clients ask for); when null it is open, like /healthz.
    metrics_key: str | None = Field(None, min_length=1)
    # Signs the web inspector's (/ui) session cookies; give every replica the same one. When
    # null, a secret made at start-up: sessions end on restart and do not cross replicas.
    ui_secret: str | None = Field(None, min_length=16)
    # The inspector's cookies are sent over HTTPS only (`Secure`): set it when /ui is served
    # through TLS (a proxy in front of memproxy), as it should be beyond localhost.
    ui_secure_cookies: bool = False
    # The background job queue (memory extraction): how often each replica looks for due jobs
    # (it also looks at once when it queues one), how many it runs at a time, how long a job
    # may run before another replica may take it over, and its retries.
    jobs_poll_seconds: float = Field(2.0, gt=0)
    job_concurrency: int = Field(2, ge=1, le=64)
    job_lease_seconds: float = Field(300.0, gt=0)
    job_max_attempts: int = Field(5, ge=1)
    job_retry_seconds: float = Field(10.0, gt=0)
    # Recall's vectors kept in memory per user (loaded from the database incrementally), in
    # all; the least recently used users' go first.
    embedding_cache_mb: int = Field(256, ge=0)
    # Documents uploaded to /v1/memory/conversations/{id}/attachments: the file (or JSON
    # content) as received, at most; and its extracted text, in tiktoken tokens, at most.
    # An upload may be larger than max_body_bytes up to this size.
    max_attachment_bytes: int = Field(10_000_000, gt=0)
    max_attachment_tokens: int = Field(200_000, gt=0)
    # Each replica's upkeep, this often: tenants' retention, and (PostgreSQL, where another
    # replica may have crashed) exchanges left `in_progress` for `stale_exchange_minutes`,
    # longer than any stream lasts, marked `incomplete`.
    maintenance_seconds: float = Field(60.0, gt=0)
    # On SIGTERM: stop accepting, let requests and streams in flight finish for at most this
    # long, then close what is left (its exchanges end `incomplete`).
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    stale_exchange_minutes: float = Field(15.0, gt=0)
    # Storing a turn (or its reply) that takes longer than this, or fails, degrades the request:
    # it is answered without memory (`fail_open`, per tenant) and what it would have stored
    # goes to the spill, a local file replayed into the database every `spill_replay_seconds`
    # once it answers. A full spill (`spill_max_bytes`; 0: no spill) turns degradation into a
    # 503. Replicas on one host may share the file.
    storage_timeout_ms: int = Field(3000, gt=0)
    spill_path: str = "./memproxy-spill.jsonl"
    spill_max_bytes: int = Field(64 * 2**20, ge=0)
    spill_replay_seconds: float = Field(5.0, gt=0)
    # After this many storage failures or timeouts in a row, requests are degraded at once,
    # without trying the database (reason `circuit_open`), for `storage_breaker_open_seconds`;
    # then one request tries it, and its success, or a spill replay that stores, closes the
    # circuit. 0 (the default): no breaker, every request tries (and may wait
    # `storage_timeout_ms`). Off by default: under overload (the process queueing, not the
    # database) it can feed on its own timeouts and degrade most requests
    # (docs/operations/database-away.md).
    storage_breaker_threshold: int = Field(0, ge=0)
    storage_breaker_open_seconds: float = Field(5.0, gt=0)
    # GET /v1/memory/users/{id}/export reads and sends the user's rows this many at a time
    # (attachments, whose text may be large, at most 10): what one export holds in memory.
    export_page_rows: int = Field(500, ge=1)
    # Debugging only: log the messages of each chat request and its reply (content is
    # otherwise never logged). Keys are never logged.
    log_content: bool = False


# The drivers memproxy runs on, and the schemes taken to mean them (as hosting platforms
# hand out `postgres://...`).
_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "postgres": "postgresql+asyncpg",
    "postgresql": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
}


class DatabaseConfig(_Strict):
    url: str = "sqlite+aiosqlite:///./memproxy.db"
    # PostgreSQL connections each replica keeps (and may open beyond them under load).
    pool_size: int = Field(10, ge=1)
    max_overflow: int = Field(20, ge=0)
    # At start-up (`serve`, `migrate`), how long to keep trying a database that cannot be
    # reached yet (one starting beside the proxy); then exit with the reason.
    connect_wait_seconds: float = Field(30.0, ge=0)

    @field_validator("url")
    @classmethod
    def _known_driver(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        driver = _DRIVERS.get(scheme.lower()) if sep else None
        if driver is None:
            shown = scheme if sep else "no scheme"
            raise ValueError(
                "use sqlite+aiosqlite:///path/to/file.db or "
                f"postgresql+asyncpg://user:password@host/database ({shown} given)"
            )
        url = f"{driver}://{rest}"
        if rest.split("/", 1)[0].count("@") > 1:
            raise ValueError("write an '@' in the user name or password as %40")
        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError):
            raise ValueError("not a database URL (look at the host and port)") from None
        if "sslmode" in parsed.query and driver == "postgresql+asyncpg":
            # libpq's name for it, in the URLs hosting platforms give; asyncpg's is `ssl`.
            mode = parsed.query["sslmode"]
            parsed = parsed.difference_update_query(["sslmode"]).update_query_dict({"ssl": mode})
            return parsed.render_as_string(hide_password=False)
        return url
