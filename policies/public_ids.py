"""Public ids of rows numbered by the database (messages, jobs): `msg_` or `job_` and 15
consonants, a keyed permutation of the row's key, so that ids say nothing about how many rows
there are (`msg_18` told every client how many messages all tenants had stored).

The permutation is a balanced Feistel network over 64 bits with a keyed BLAKE2b round
function: reversible with the key, so a lookup by id is a lookup by primary key, as before,
and no column or index is added. Ids are letters only, so the decimal ids given before
(`msg_18`) are told apart and still accepted.
"""

from __future__ import annotations

import hashlib
import re

MESSAGE, JOB = "msg", "job"  # the prefixes of the ids of each kind
PUBLIC_IDS = "public_ids"  # the name of the key among the deployment's secrets
# Consonants only: an id never spells a word (nor a user's name a test looks for).
ALPHABET = "bcdfghjklmnpqrstvwxz"
WIDTH = 15  # letters: 20**15 > 2**64
ROUNDS = 8
_HALF = 0xFFFFFFFF
_OLD = re.compile(r"[0-9]{1,18}")  # the decimal ids given before
_NEW = re.compile(f"[{ALPHABET}]{{{WIDTH}}}")
MAX_KEY = 2**63 - 1  # a primary key (a signed 64-bit integer)
# Ids formatted lately, kept: a conversation's recalled turns come back turn after turn, and
# each id is eight keyed hashes. Dropped whole when full (a bound, not an eviction policy).
KEPT_IDS = 65536


class PublicIds:
    """Formats and parses the public ids of one deployment (`key`: its secret, the same for
    every replica)."""

    def __init__(self, key: bytes) -> None:
        if not 16 <= len(key) <= 64:
            raise ValueError("the key must be 16-64 bytes")
        self._key = key
        # The round function's hash with its key taken in, copied for each round (taking
        # the key in is most of a short hash's cost).
        self._keyed = hashlib.blake2b(key=key, digest_size=4)
        self._formatted: dict[tuple[str, int], str] = {}

    def format(self, prefix: str, pk: int) -> str:
        """The public id of row `pk` of the kind `prefix` names (`msg`, `job`)."""
        found = self._formatted.get((prefix, pk))
        if found is not None:
            return found
        if not 0 <= pk <= MAX_KEY:
            raise ValueError(f"not a row key: {pk}")
        n = self._permute(prefix, pk)
        letters = []
        for _ in range(WIDTH):
            n, digit = divmod(n, len(ALPHABET))
            letters.append(ALPHABET[digit])
        formatted = f"{prefix}_{''.join(reversed(letters))}"
        if len(self._formatted) >= KEPT_IDS:
            self._formatted.clear()
        self._formatted[prefix, pk] = formatted
        return formatted

    def parse(self, prefix: str, value: str) -> int | None:
        """The row a public id of the kind `prefix` names (this form or the decimal one given
        before), or None when `value` is no such id."""
        if not value.startswith(prefix + "_"):
            return None
        body = value[len(prefix) + 1 :]
        if _OLD.fullmatch(body):
            return int(body)
        if not _NEW.fullmatch(body):
            return None
        n = 0
        for letter in body:
            n = n * len(ALPHABET) + ALPHABET.index(letter)
        if n >= 2**64:
            return None
        pk = self._permute(prefix, n, inverse=True)
        return pk if pk <= MAX_KEY else None

    def _round(self, prefix: str, number: int, half: int) -> int:
        data = prefix.encode() + bytes([number]) + half.to_bytes(4, "big")
        keyed = self._keyed.copy()
        keyed.update(data)
        return int.from_bytes(keyed.digest(), "big")

    def _permute(self, prefix: str, value: int, *, inverse: bool = False) -> int:
        left, right = value >> 32, value & _HALF
        if not inverse:
            for number in range(ROUNDS):
                left, right = right, left ^ self._round(prefix, number, right)
        else:
            for number in reversed(range(ROUNDS)):
                left, right = right ^ self._round(prefix, number, left), left
        return (left << 32) | right
