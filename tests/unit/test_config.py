from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from proxy.core.config import ConfigError
from proxy.core.config_file import load_config, tenant_keys

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_shipped_config_loads_with_no_environment() -> None:
    config = load_config(REPO / "config.yaml", environ={})
    demo = config.tenants["demo"]
    assert demo.upstream == "echo"
    assert config.upstreams["echo"].kind == "echo"
    assert demo.context.token_budget == 2000
    assert demo.memory.extract == "off"  # bare YAML `off` is the string, not false
    assert "openai" not in config.upstreams  # unused, so its missing key is no error
    server = config.server
    assert (server.storage_breaker_threshold, server.storage_breaker_open_seconds) == (0, 5)


def test_defaults_merge_into_tenants_key_by_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
defaults:
  context: {token_budget: 1000, min_recent_messages: 2}
  limits: {rpm: 60}
tenants:
  a: {api_keys: [ka], context: {token_budget: 4000}}
  b: {api_keys: [kb]}
""",
    )
    config = load_config(path, environ={})
    a, b = config.tenants["a"], config.tenants["b"]
    assert (a.context.token_budget, a.context.min_recent_messages) == (4000, 2)
    assert (b.context.token_budget, b.context.min_recent_messages) == (1000, 2)
    assert a.limits.rpm == b.limits.rpm == 60
    assert a.context.placement == "before_last_user"


def test_env_vars_expand_and_missing_ones_name_the_key(tmp_path: Path) -> None:
    text = """
upstreams:
  openai: {kind: openai, base_url: "http://x/v1", api_key: "${UP_KEY}"}
tenants:
  a: {api_keys: ["${APP_KEY}"], upstream: openai}
"""
    path = write(tmp_path, text)
    config = load_config(path, environ={"UP_KEY": "sk-up", "APP_KEY": "app"})
    assert config.upstreams["openai"].api_key == "sk-up"
    assert tenant_keys(config)[hashlib.sha256(b"app").hexdigest()][0] == "a"
    with pytest.raises(
        ConfigError, match=r"^upstreams\.openai\.api_key: environment variable UP_KEY"
    ):
        load_config(path, environ={"APP_KEY": "app"})
    with pytest.raises(
        ConfigError, match=r"^tenants\.a\.api_keys\.0: environment variable APP_KEY"
    ):
        load_config(path, environ={"UP_KEY": "k"})


def test_keys_hashed_scoped_and_unique(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"secret").hexdigest()
    path = write(
        tmp_path,
        f"""
tenants:
  a: {{api_keys: ["sha256:{digest}", {{key: plain, scopes: [chat]}}, {{key: ak, user: al}}]}}
""",
    )
    keys = tenant_keys(load_config(path, environ={}))
    assert keys[digest] == ("a", frozenset({"chat", "manage"}), None)
    assert keys[hashlib.sha256(b"plain").hexdigest()] == ("a", frozenset({"chat"}), None)
    assert keys[hashlib.sha256(b"ak").hexdigest()] == ("a", frozenset({"chat", "manage"}), "al")
    dup = write(tmp_path, "tenants:\n  a: {api_keys: [k]}\n  b: {api_keys: [k]}\n", "dup.yaml")
    with pytest.raises(
        ConfigError, match=r"tenants\.b\.api_keys\.0: key already belongs to tenant 'a'"
    ):
        load_config(dup, environ={})


@pytest.mark.parametrize("user", ['"."', '".."', '"  "'])
def test_a_key_bound_to_a_user_id_no_route_takes_is_an_error(tmp_path: Path, user: str) -> None:
    # (`.` and `..` are refused wherever a request names a user: their export and erasure
    # could not be reached, URL clients rewrite those path segments.)
    path = write(tmp_path, f"tenants:\n  a: {{api_keys: [{{key: k, user: {user}}}]}}\n")
    why = r"(cannot be '\.' or '\.\.'|must be a non-empty string)"
    with pytest.raises(ConfigError, match=rf"tenants\.a\.api_keys\.0\.user: .*a user id {why}"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("keys", "environ"),
    [('["${KEY}"]', {"KEY": ""}), ('["  "]', {}), ('[{key: " k"}]', {}), ('["k "]', {})],
)
def test_a_key_no_client_could_send_is_an_error(
    tmp_path: Path, keys: str, environ: dict[str, str]
) -> None:
    path = write(tmp_path, f"tenants:\n  a: {{api_keys: {keys}}}\n")
    with pytest.raises(ConfigError, match=r"tenants\.a\.api_keys\.0: a key may not be empty"):
        load_config(path, environ=environ)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ('["sha256:abc"]', "a hashed key is 'sha256:' and the key's 64 hex digits"),
        ('["sha256:this-is-my-plain-key"]', "a hashed key is 'sha256:'"),
        ('["clé-secrète"]', "a key is printable ASCII"),
        ('["tab\\tkey"]', "a key is printable ASCII"),
        ("[k1, {key: k1, scopes: [chat]}]", "key listed twice for this tenant"),
        (f'["SHA256:{"ab" * 32}", "sha256:{"AB" * 32}"]', "key listed twice for this tenant"),
    ],
)
def test_a_key_that_would_not_work_as_written_is_an_error(
    tmp_path: Path, keys: str, message: str
) -> None:
    """A hashed key that is no digest never matches; an upper-case `SHA256:` prefix was read
    as a plain key (the digest itself a working key); a key outside ASCII never matches the
    header a client sends; a key listed twice had its last scopes win silently."""
    path = write(tmp_path, f"tenants:\n  a: {{api_keys: {keys}}}\n")
    with pytest.raises(ConfigError, match=r"^tenants\.a\.api_keys\.\d: " + message):
        load_config(path, environ={})


def test_an_upper_case_hashed_key_is_hashed(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"secret").hexdigest()
    path = write(tmp_path, f'tenants:\n  a: {{api_keys: ["SHA256:{digest.upper()}"]}}\n')
    assert tenant_keys(load_config(path, environ={})) == {
        digest: ("a", frozenset({"chat", "manage"}), None)
    }


def test_a_key_given_twice_in_one_mapping_is_an_error(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: the first tenant `a` was lost unnoticed."""
    path = write(tmp_path, "tenants:\n  a: {api_keys: [k1]}\n  a: {api_keys: [k2]}\n")
    with pytest.raises(ConfigError, match=r"line 3: not valid YAML \(the key 'a' is given twice"):
        load_config(path, environ={})
    merged = "tenants:\n  a: &a {api_keys: [k1], upstream: echo}\n  b: {<<: *a, api_keys: [k2]}\n"
    config = load_config(write(tmp_path, merged), environ={})  # (a merge key is no repeat)
    assert (config.tenants["b"].api_keys, config.tenants["b"].upstream) == (["k2"], "echo")


def test_include_adds_tenants_and_rejects_duplicates(tmp_path: Path) -> None:
    write(
        tmp_path, "acme: {api_keys: [acme-key], context: {token_budget: 10}}\n", "tenants/acme.yaml"
    )
    path = write(tmp_path, "tenants:\n  demo: {api_keys: [d]}\ninclude: [tenants/*.yaml]\n")
    config = load_config(path, environ={})
    assert set(config.tenants) == {"demo", "acme"}
    assert config.tenants["acme"].context.token_budget == 10
    write(tmp_path, "demo: {api_keys: [other]}\n", "tenants/zz.yaml")
    with pytest.raises(ConfigError, match=r"tenants\.demo: defined twice"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "tenants:\n  a: {api_keys: [k], context: {token_budget: lots}}\n",
            r"^tenants\.a\.context\.token_budget: ",
        ),
        (
            "tenants:\n  a: {api_keys: [k], upstream: nowhere}\n",
            r"^tenants\.a\.upstream: no upstream named 'nowhere'",
        ),
        (
            "tenants:\n  a: {api_keys: [k], summaries: {upstream: nowhere}}\n",
            r"^tenants\.a\.summaries\.upstream: no upstream named 'nowhere'",
        ),
        ("tenants:\n  a: {api_keys: []}\n", r"^tenants\.a\.api_keys: "),
        ("tenants:\n  a: {api_keys: [k], colour: blue}\n", r"^tenants\.a\.colour: Extra inputs"),
        (
            "tenants:\n  a: {api_keys: [{key: k, scopes: [root]}]}\n",
            r"^tenants\.a\.api_keys\.0\.scopes\.0: ",
        ),
        (
            "upstreams:\n  u: {kind: grpc}\ntenants:\n  a: {api_keys: [k], upstream: u}\n",
            r"^upstreams\.u\.kind: ",
        ),
        ("server: {max_body_bytes: -1}\n", r"^server\.max_body_bytes: "),
        # A mistake under defaults is reported there, not under the first tenant.
        (
            "defaults: {context: {token_budjet: 9}}\ntenants:\n  a: {api_keys: [k]}\n",
            r"^defaults\.context\.token_budjet: Extra inputs",
        ),
        # An upstream no tenant uses yet is checked too (unless it names unset variables).
        ("upstreams:\n  spare: {kind: opnai}\n", r"^upstreams\.spare\.kind: "),
        ("include: 5\n", r"^include: expected a file pattern"),
        ("include: [tenants/*.yaml, 7]\n", r"^include: expected a file pattern"),
        ("include: acme.yaml\n", r"^include: no file 'acme.yaml'"),
        (
            "server: {storage_breaker_threshold: -1}\n",
            r"^server\.storage_breaker_threshold: ",
        ),
        (
            "server: {storage_breaker_open_seconds: 0}\n",
            r"^server\.storage_breaker_open_seconds: ",
        ),
        ("servr: {}\n", r"^servr: unknown top-level key"),
        ("tenants: [a, b]\n", r"^tenants: expected a mapping"),
        ("tenants:\n  a: {api_keys: [k]\n", r"line \d+: not valid YAML"),
    ],
)
def test_bad_config_fails_with_one_line_naming_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(write(tmp_path, text), environ={})
    assert "\n" not in str(info.value)


def test_secret_values_never_appear_in_errors(tmp_path: Path) -> None:
    path = write(tmp_path, "tenants:\n  a: {api_keys: [{key: hunter2-secret, scopes: [nope]}]}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("postgres://u:pw@db/memproxy", "postgresql+asyncpg://u:pw@db/memproxy"),
        ("postgresql://u@db:5433/m", "postgresql+asyncpg://u@db:5433/m"),
        ("postgresql+asyncpg://u@db/m", "postgresql+asyncpg://u@db/m"),
        ("sqlite:///data/m.db", "sqlite+aiosqlite:///data/m.db"),
        ("SQLite+aiosqlite:///m.db", "sqlite+aiosqlite:///m.db"),
        # libpq's sslmode, as hosting platforms give it, is asyncpg's ssl.
        (
            "postgres://u:p%40ss@db/m?sslmode=require",
            "postgresql+asyncpg://u:p%40ss@db/m?ssl=require",
        ),
    ],
)
def test_database_urls_name_the_async_driver(tmp_path: Path, given: str, url: str) -> None:
    path = write(tmp_path, f"database: {{url: '{given}'}}\ntenants:\n  a: {{api_keys: [k]}}\n")
    assert load_config(path, environ={}).database.url == url


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ("mysql://u:hunter2@db/m", "mysql given"),
        ("postgresql+psycopg2://u:hunter2@db/m", "postgresql+psycopg2 given"),
        ("hunter2.db", "no scheme given"),
        ("postgres://u:hunter2@x@db/m", "write an '@'"),
        ("postgres://u:hunter2@db:port/m", "not a database URL"),
    ],
)
def test_a_database_url_memproxy_cannot_use_is_refused_without_showing_it(
    tmp_path: Path, given: str, named: str
) -> None:
    path = write(tmp_path, f"database: {{url: '{given}'}}\ntenants:\n  a: {{api_keys: [k]}}\n")
    with pytest.raises(ConfigError, match=r"^database\.url: Value error, ") as info:
        load_config(path, environ={})
    assert named in str(info.value)
    assert "hunter2" not in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml", environ={})


def test_include_takes_one_pattern_as_a_string_and_globs_may_match_nothing(
    tmp_path: Path,
) -> None:
    write(tmp_path, "acme: {api_keys: [ka]}\n", "acme.yaml")
    config = load_config(write(tmp_path, "include: acme.yaml\n"), environ={})
    assert list(config.tenants) == ["acme"]
    assert load_config(write(tmp_path, "include: [none.d/*.yaml]\n"), environ={}).tenants == {}


def test_an_unused_upstream_may_name_unset_variables(tmp_path: Path) -> None:
    path = write(tmp_path, "upstreams:\n  spare: {kind: openai, api_key: '${SPARE_KEY}'}\n")
    assert "spare" not in load_config(path, environ={}).upstreams


def test_defaults_that_are_valid_only_once_merged_are_accepted(tmp_path: Path) -> None:
    # The policy names a label each tenant defines: not valid alone, valid in every tenant.
    path = write(
        tmp_path,
        """
defaults:
  intent: {policies: {smalltalk: {memory: false}}}
tenants:
  a:
    api_keys: [ka]
    intent: {labels: {smalltalk: {description: "greetings and chit-chat"}}}
""",
    )
    assert "smalltalk" in load_config(path, environ={}).tenants["a"].intent.policies


@pytest.mark.parametrize("url", ["localhost:9/v1", "ftp://host/v1", "http:///v1", "/v1"])
def test_an_upstream_url_without_scheme_or_host_is_an_error_at_start(
    tmp_path: Path, url: str
) -> None:
    """It used to start, then answer every request 502 `unreachable`."""
    path = write(
        tmp_path,
        f'upstreams:\n  o: {{kind: openai, base_url: "{url}", api_key: x}}\n'
        "tenants:\n  a: {api_keys: [k], upstream: o}\n",
    )
    with pytest.raises(ConfigError, match=r"^upstreams\.o\.base_url: .*http:// or https://"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    ("upstream", "mode"),
    [
        ("{kind: openai, base_url: 'http://h/v1', api_key: x}", "native"),
        ("{kind: openai, base_url: 'http://h/v1', api_key: x, responses: translate}", "translate"),
        ("{kind: litellm}", "translate"),
        ("{kind: echo}", "translate"),
        ("{kind: echo, responses: translate}", "translate"),
    ],
)
def test_an_upstream_serves_responses_natively_only_when_it_is_openai_kind(
    tmp_path: Path, upstream: str, mode: str
) -> None:
    """Unset: native for `openai`, which keeps its responses; translated through chat
    completions (memproxy keeping the responses) for the others, or when a config says so."""
    text = f"upstreams:\n  u: {upstream}\ntenants:\n  a: {{api_keys: [k], upstream: u}}\n"
    path = write(tmp_path, text)
    assert load_config(path, environ={}).upstreams["u"].responses_mode() == mode


@pytest.mark.parametrize("kind", ["echo", "litellm"])
def test_native_responses_on_an_upstream_without_them_is_an_error_naming_the_key(
    tmp_path: Path, kind: str
) -> None:
    path = write(tmp_path, f"upstreams:\n  u: {{kind: {kind}, responses: native}}\n")
    with pytest.raises(ConfigError, match=r"^upstreams\.u: .*responses: native needs an openai"):
        load_config(path, environ={})
    bad = write(tmp_path, "upstreams:\n  u: {kind: echo, responses: stateful}\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"^upstreams\.u\.responses: "):
        load_config(bad, environ={})


SECRET = "s" * 32


@pytest.mark.parametrize(
    ("identity", "error"),
    [
        ("{mode: token, secret: " + SECRET + "}", r": .*needs algorithms"),
        ("{mode: token, algorithms: [HS256]}", r"exactly one of secret, public_key_file"),
        ("{mode: token, algorithms: [none], secret: " + SECRET + "}", r"algorithms\.0"),
        ("{mode: token, algorithms: [RS256], secret: " + SECRET + "}", r"a secret signs HS"),
        ("{mode: token, algorithms: [HS256, RS256], secret: " + SECRET + "}", r"HS\*"),
        ("{mode: token, algorithms: [HS256], secret: short}", r"\.secret: .*32 characters$"),
        ("{mode: token, algorithms: [RS256], public_key_file: nope.pem}", r"cannot read"),
        ("{mode: header, secret: " + SECRET + "}", r"secret is a setting of mode: token"),
        ("{mode: header, allow_anonymous: true}", r"allow_anonymous is a setting"),
    ],
)
def test_an_identity_that_cannot_be_used_is_one_line_naming_it(
    tmp_path: Path, identity: str, error: str
) -> None:
    path = write(tmp_path, f"tenants:\n  a: {{api_keys: [k], identity: {identity}}}\n")
    with pytest.raises(ConfigError, match=rf"^tenants\.a\.identity.*{error}"):
        load_config(path, environ={})


def test_tenants_never_share_token_key_material(tmp_path: Path) -> None:
    """A secret (or key file) two tenants share would let one's tokens act in the other."""
    token = '{mode: token, algorithms: [HS256], secret: "${S}"}'
    path = write(
        tmp_path,
        f"tenants:\n  a: {{api_keys: [k1], identity: {token}}}\n"
        f"  b: {{api_keys: [k2], identity: {token}}}\n",
    )
    with pytest.raises(ConfigError, match=r"tenants\.b\.identity\.secret: the same as tenant 'a'"):
        load_config(path, environ={"S": SECRET})
    shared = write(tmp_path, f"defaults: {{identity: {token}}}\ntenants:\n  a: {{api_keys: [k]}}\n")
    with pytest.raises(ConfigError, match=r"^defaults\.identity: set identity per tenant"):
        load_config(shared, environ={"S": SECRET})
