"""PostgreSQL: each user's word counts, for ranking by how rare a word is

`ts_rank` weighs every word of a question alike, so a name the user says in every turn counts
as much as the question's rarest word, and every row holding it is ranked. SQLite's bm25
weighs each word by its idf, from how many rows hold it. `message_words` gives PostgreSQL the
same counts, per tenant and user: for each word (an English lexeme of `search_vector`), how
many of the user's searchable messages hold it; the word '' (no lexeme is empty) counts the
messages themselves. Statement triggers keep it in step with every insert, edit and delete of
a message, in the same transaction, so an erased user's words go with their messages, and a
count that falls to zero is deleted; a TRUNCATE of the messages empties it.

Not counted: the `anonymous` user (`proxy.pipeline.memory.ANONYMOUS`), who recalls within one
conversation only (counted there when searched): one count shared by every anonymous
conversation of a tenant would make all their writes wait for each other.

A statement's counts change in one order (tenant, user, word), the user's '' first, so
writers of the same user wait for each other instead of deadlocking.

SQLite is unchanged: FTS5 counts what its bm25 needs itself.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-24 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _words(rows: str, change: int = 1) -> str:
    """Each word of each searchable row of `rows` (and '' for the row itself), `change`d."""
    return (
        "SELECT tenant_id, user_id, "
        f"unnest(array_append(tsvector_to_array(search_vector), '')) AS word, {change} AS change "
        f"FROM {rows} WHERE search_text IS NOT NULL AND user_id <> 'anonymous'"
    )


def _apply(changes: str) -> str:
    return f"""
        INSERT INTO message_words AS w (tenant_id, user_id, word, messages)
        SELECT tenant_id, user_id, word, sum(change) FROM ({changes}) c
        GROUP BY tenant_id, user_id, word HAVING sum(change) <> 0
        ORDER BY tenant_id, user_id, word
        ON CONFLICT (tenant_id, user_id, word)
        DO UPDATE SET messages = w.messages + excluded.messages;"""


_EMPTIED = f"""
        DELETE FROM message_words w USING (SELECT DISTINCT tenant_id, user_id, word
            FROM ({_words("old_rows")}) c) o
        WHERE w.tenant_id = o.tenant_id AND w.user_id = o.user_id AND w.word = o.word
        AND w.messages <= 0;"""

_EDITED = _words("old_rows", -1) + " UNION ALL " + _words("new_rows")
# (most updates of messages change no word: a turn's intent goes into its metadata)
_WORDS_CHANGED = (
    "EXISTS (SELECT 1 FROM old_rows o JOIN new_rows n ON n.pk = o.pk "
    "WHERE (o.search_text, o.tenant_id, o.user_id) IS DISTINCT FROM "
    "(n.search_text, n.tenant_id, n.user_id))"
)
COUNTED = f"""
CREATE FUNCTION message_words_counted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN{_apply(_words("new_rows"))}
    ELSIF TG_OP = 'UPDATE' THEN
        IF {_WORDS_CHANGED} THEN{_apply(_EDITED)}{_EMPTIED}
        END IF;
    ELSIF TG_OP = 'DELETE' THEN{_apply(_words("old_rows", -1))}{_EMPTIED}
    ELSE
        DELETE FROM message_words;
    END IF;
    RETURN NULL;
END $$
"""
# (a trigger with transition tables fires on one event only; TRUNCATE has none)
TRANSITIONS = {
    "insert": "REFERENCING NEW TABLE AS new_rows",
    "update": "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows",
    "delete": "REFERENCING OLD TABLE AS old_rows",
    "truncate": "",
}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE TABLE message_words (tenant_id VARCHAR(128) NOT NULL, "
        "user_id VARCHAR(256) NOT NULL, word TEXT NOT NULL, messages INTEGER NOT NULL, "
        "CONSTRAINT pk_message_words PRIMARY KEY (tenant_id, user_id, word))"
    )
    op.execute(COUNTED)
    for event, transitions in TRANSITIONS.items():
        # (each waits for the messages being written now, then holds the next ones back
        # until the counts below are in)
        op.execute(
            f"CREATE TRIGGER message_words_on_{event} AFTER {event.upper()} ON messages "
            f"{transitions} FOR EACH STATEMENT "
            "EXECUTE FUNCTION message_words_counted()"
        )
    op.execute(
        "INSERT INTO message_words (tenant_id, user_id, word, messages) "
        f"SELECT tenant_id, user_id, word, count(*) FROM ({_words('messages')}) c "
        "GROUP BY tenant_id, user_id, word"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for event in TRANSITIONS:
        op.execute(f"DROP TRIGGER message_words_on_{event} ON messages")
    op.execute("DROP FUNCTION message_words_counted()")
    op.execute("DROP TABLE message_words")
