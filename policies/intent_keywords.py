"""The keyword classifier of intent (its result: `Intent`, policies/intent.py).

It is deterministic and takes microseconds: each label has keywords (whole words or phrases) and
regular expressions, each match adds to its score, and structural cues adjust the default
labels: a question mark (not on a polite request, "could you shorten this?"), a new deliverable
asked for ("write a ...", "make me a ..."), thanks, a greeting or an aside that opens the turn
(what follows it decides), a remark about the user with nothing asked (small talk), and for
`follow_up` a turn that leans on the conversation so far when there is one: a change to the
answer ("add type hints", "make the tone warmer"), a short turn with a reference ("it", "the
first one", "again"), one opening with a conjunction ("and in French?"), or a short question
with no question word of its own ("ratio for a 1 liter jar?"). No history, no follow-up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.intent import Intent
from policies.intent_labels import DEFAULT_LABELS, FOLLOW_UP, OTHER, TASK_VERBS, LabelSpec

# The part of a turn the keyword classifier reads.
CLASSIFY_CHARS = 2_000
# Structural cues.
_SHORT_WORDS = 10
_REFERENCE = re.compile(
    r"\b(?:it|that|this|them|those|these|the same|above|again|one|ones|instead|too|as well)\b"
)
# Typographic apostrophes as typed ones; an opening ¿ or ¡ dropped (the question or exclamation
# is read from its end).
_NORMALISE = str.maketrans({"\u2019": "'", "\u2018": "'", "¿": " ", "¡": " "})
_WORD = re.compile(r"[^\W\d_]+")
_ABOUT_YOU = re.compile(
    r"^(?:and |so |but )?(?:do|are|have|did|were|would|will) you\b(?! (?:know|have access|"
    r"support|speak|remember|able|allowed|capable|work|sure|mean|think))|^(?:what|how|where|who) "
    r"(?:\w+ )?(?:are|do|did|were|have) you (?:been |like )?(?:up to|doing|do|from|feel|"
    r"feeling|been)\b|^who (?:made|created|built|trained) you\b|\b(?:your|ur) (?:favou?rite|day|"
    r"weekend|night|morning|hobbies|mood)\b|^how(?:'s|s| is| was| are| has| have) (?:your|ur|"
    r"you|u)\b"
)
_FEELING = re.compile(
    r"\b(?:i'?m|i am|feeling|i feel|i'm so|im so)\b(?: \w+)?\s*(?:so |really |very |kinda |"
    r"a bit |super )?(?:tired|bored|sad|happy|excited|stressed|nervous|exhausted|lonely|"
    r"hungry|sleepy|sick|anxious|frustrated|annoyed|glad|awful|terrible|down|great|good|fine|"
    r"okay|ok)\b|\bmy name is\b|\bi'?m called\b"
)
# A turn that opens with a conjunction leans on what came before ("and in French?", "e quanto
# ...?", "ok and over 30 years?"), if it is short.
_CONNECTED_WORDS = 6
_CONNECTOR = re.compile(
    r"^(?:(?:ok|okay) )?(?:and|but|so|also|then|what if|wait|or|plus|"
    r"e|ed|ma|oppure|y|o|pero|et|mais|ou|und|aber|oder|mas)\b(?!')"
)
# How a question opens: a question word or an auxiliary verb, in the languages the labels know.
# A short question after an answer with none of them ("ratio for a 1 liter jar?", "und ein
# Apfel?", "Kannst du das formeller formulieren?") is elliptical: it leans on the answer.
_QUESTION_OPENER = re.compile(
    r"^(?:what|whats|who|whom|whose|when|where|which|why|how|is|are|was|were|does|do|did|can|"
    r"could|should|would|will|has|have|had|am|isn't|aren't|doesn't|don't|didn't|may|might|must|"
    r"shall|quel|quelle|quels|quelles|qui|quand|où|comment|combien|pourquoi|est-ce|qu'est-ce|"
    r"que|quoi|qué|quién|quiénes|cuándo|dónde|cuál|cuáles|cuánto|cuánta|cuántos|cuántas|cómo|"
    r"por qué|es|son|hay|o que|quem|quando|onde|qual|quais|quanto|quanta|quantos|quantas|como|"
    r"porque|por que|chi|cosa|che|dove|quale|quali|perché|è|wer|wen|wem|wessen|wann|wo|welche|"
    r"welcher|welches|warum|wieso|weshalb|wie|was|ist|sind|gibt)\b(?!'t\b)"
)
_ELLIPTICAL_WORDS = 8
# A change asked of what the assistant just produced: an edit verb on it, or on no object of
# its own ("add type hints", "make the tone warmer", "now do it in rust").
_LEAD = r"^(?:(?:ok|okay|now|then|also|and|great|perfect|cool|nice|so)[, ]+)*"
_POLITE = (
    r"(?:please |pls |kindly |(?:can|could|would|will) (?:you|u) (?:please |pls |also |just |"
    r"maybe |now |quickly )?)?"
)
_EDIT = re.compile(
    rf"{_LEAD}{_POLITE}(?:add|remove|delete|drop|cut|trim|change|tweak|adjust|shorten|"
    r"lengthen|expand|extend|continue|include|simplify|rephrase|reword|redo|use|switch|replace|"
    r"swap|keep|mention|skip|emphasi[sz]e|tone (?:it )?down|"
    r"(?:make|do|fix|rewrite|translate|put|turn|convert|explain|say|write|show|try|format|"
    r"redo|update|edit|check|test) (?:it|that|this|them|these|those|the same|the \w+|all|"
    r"everything|again)|give (?:me )?(?:an?|another|more|some|one more) (?:examples?|"
    r"alternatives?|options?|versions?))\b"
)
# A new deliverable, asked for with an indefinite object ("write a README", "make me a
# grocery list", "give me 5 titles"): a task even after an answer.
_CREATE = re.compile(
    rf"{_LEAD}{_POLITE}(?:write|draft|compose|create|generate|make|build|give|design|plan|"
    r"produce|prepare|suggest|come up with|brainstorm|list) (?:me |us |him |her |them )?"
    r"(?:a|an|some|\d+|two|three|four|five|six|seven|eight|nine|ten|a few|several)\b"
)
# A polite request ("could you shorten ...?"): its question mark does not make it a question.
_ASKS_YOU_TO = re.compile(
    r"\b(?:(?:can|could|would|will) (?:you|u)|(?:you|u) (?:can|could)) (?:please |pls |also |"
    r"just |maybe |quickly )?"
    rf"(?:{TASK_VERBS})\b"
)
# Thanks, praise, a greeting or an aside that opens a turn and is set off by punctuation
# ("thanks, that helps. also, ...", "hey quick q - ...", "ok cool. btw ..."): what follows
# it decides if the turn asks for something.
_OPENER_WORD = (
    r"(?:ok(?:ay)?|ok cool|cool|great|perfect|nice|awesome|amazing|excellent|brilliant|wonderful|"
    r"thanks?(?: you)?(?: (?:so|very) much| a lot| again| for [^.!?,;:]{1,40})?|thx|ty|cheers|"
    r"merci(?: beaucoup)?|gracias|danke(?: schön| sehr)?|grazie|obrigad[oa]|got it|"
    r"that helps|that helped|good|alright|sure|yes|yeah|yep|wow|hi+|hey+|hello|hallo|hola|"
    r"olá|bonjour|salut|ciao|good (?:morning|afternoon|evening)|there|btw|by the way|also|"
    r"anyway|unrelated|off topic|quick q(?:uestion)?|(?:separate|different|another|new|random|"
    r"side|one more) question)"
)
_ASIDE = (
    r"(?:btw|by the way|unrelated|off topic|quick q(?:uestion)?|(?:separate|different|another|"
    r"new|random|side|one more) question)"
)
# One word or phrase of an opener and what follows it (group 1 is punctuation, if any); read
# a step at a time, a few steps at most, so no input makes it backtrack far.
_OPENER_STEP = re.compile(
    rf"{_OPENER_WORD}\b(?:\s*([,.!:;\u2014\u2013]+|\s-)[\s,.!:;\u2014\u2013-]*|\s+)"
)
_OPENER_STEPS = 6
_ASIDE_STEP = re.compile(rf"{_ASIDE}\b[\s,.:;\u2014\u2013-]*")
# An aside that starts a new topic: what follows it does not lean on the conversation.
_NEW_TOPIC = re.compile(rf"\b{_ASIDE}\b")
# A statement about the user (or the day) with nothing asked: small talk.
_PERSONAL = re.compile(r"\b(?:i|i'm|im|i've|i'll|my|me|we|we're|our|us)\b")
_MATERIAL = re.compile(r"(?<!:):(?![:/])\s*\S.{20,}")
# Quoted or fenced text the turn brings to work on.
_QUOTED = re.compile(r"```.*|(?<![^\s:(])(?:'[^']{25,}'|\"[^\"]{25,}\"|«[^»]{25,}»)(?!\w)")
# An acknowledgement: feedback right after an answer, nothing much on its own.
_ACK = re.compile(r"^(?:👍|👌|🙏|ok|okay|k|kk|got it|cool|noted|alright)[\s!.]*$")
# Data pasted or typed with no request: a URL, JSON or markup, a command, a test, gibberish.
_DATA = re.compile(
    r"^(?:https?://\S+|[{\[<].*|/\w+|test(?:ing)?\b.*|ping|null|undefined|none|asdf\w*)$"
    r"|^(?:sorry,? )?(?:just )?testing\b|^(?:nvm|never ?mind|ignore (?:this|that|me|it)|"
    r"(?:sorry,? |oops,? )?wrong (?:chat|window|tab|thread|person))\b"
)
_GIBBERISH = re.compile(r"^(?:(\w)\1{4,}|[^aeiouy\s]{6,})$")
# Asking for something, which decides over thanks or greetings that come with it.
_REQUESTS = ("task", FOLLOW_UP)
_ASKING = ("question", "task", FOLLOW_UP)
_SOCIAL = ("feedback", "chitchat")
# Ties go to the more specific label.
_PRIORITY = ("feedback", "chitchat", FOLLOW_UP, "task", "question", OTHER)


@dataclass(frozen=True, slots=True)
class _Compiled:
    name: str
    weight: float
    keywords: re.Pattern[str] | None  # every keyword in one alternation
    patterns: tuple[tuple[str, re.Pattern[str]], ...]
    # Whether any of the patterns matches, in one search (None: they cannot be combined).
    any_pattern: re.Pattern[str] | None

    def hits(self, turn: str) -> list[str]:
        found = (
            list(dict.fromkeys(m.group(0) for m in self.keywords.finditer(turn)))
            if (self.keywords)
            else []
        )
        if not self.patterns or (self.any_pattern and not self.any_pattern.search(turn)):
            return found  # (most turns match none of a label's patterns)
        return found + [p for p, rx in self.patterns if rx.search(turn)]


# What a pattern may hold that would mean something else inside a combined alternation: a
# numbered or named backreference or a conditional on a group (the groups are renumbered),
# global flags.
_UNCOMBINABLE = re.compile(r"\\[1-9]|\(\?P=|\(\?\(|\(\?[aiLmsux]+\)")


def _any_of(patterns: Sequence[str]) -> re.Pattern[str] | None:
    """One alternation of `patterns`: it matches a text exactly when one of them does."""
    if not patterns or any(_UNCOMBINABLE.search(p) for p in patterns):
        return None
    try:
        return re.compile("|".join(f"(?:{p})" for p in patterns))
    except re.error:  # (e.g. a group name used by two of them)
        return None


def _compile(labels: Mapping[str, LabelSpec]) -> tuple[_Compiled, ...]:
    compiled = []
    for name, spec in labels.items():
        # Longest first, so a phrase wins over a keyword it starts with.
        words = sorted({k.lower() for k in spec.keywords}, key=len, reverse=True)
        keywords = (
            re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, words)) + r")(?!\w)")
            if words
            else None
        )
        patterns = tuple((p, re.compile(p)) for p in spec.patterns)
        compiled.append(_Compiled(name, spec.weight, keywords, patterns, _any_of(spec.patterns)))
    return tuple(compiled)


class KeywordClassifier:
    """Compiled once per tenant; `classify` is a pure function of the turn and its history."""

    def __init__(self, labels: Mapping[str, LabelSpec] | None = None) -> None:
        self.labels = dict(labels or DEFAULT_LABELS)
        if OTHER not in self.labels:
            self.labels[OTHER] = DEFAULT_LABELS[OTHER]
        self._compiled = _compile(self.labels)
        order = {name: i for i, name in enumerate(_PRIORITY)}
        self._rank = {name: order.get(name, -1) for name in self.labels}  # custom labels first

    def classify(self, text: str, history: Sequence[Mapping[str, Any]] = ()) -> Intent:
        # What a turn asks is in its first lines; a long paste after them changes nothing, and
        # the rules then cost the same for every turn.
        turn = " ".join(text[:CLASSIFY_CHARS].lower().translate(_NORMALISE).split())
        has_history = any(m.get("role") == "assistant" for m in history)
        opened = _opener(turn)
        if 0 < opened < len(turn):
            # Thanks, a greeting or an aside first: what follows decides, if it says anything;
            # after "btw" or "separate question:" it does not lean on the conversation.
            said = turn[:opened].strip()
            leans = has_history and not _NEW_TOPIC.search(said)
            scores, reasons = self._scores(turn[opened:], leans, weak=False)
            if _best(scores, self._rank) not in (None, OTHER):
                return _result(scores, [f"after {said[:20]!r}", *reasons], self._rank)
            scores, reasons = self._scores(said, has_history)
            if _best(scores, self._rank) in _SOCIAL:
                return _result(scores, reasons, self._rank)
        scores, reasons = self._scores(turn, has_history)
        return _result(scores, reasons, self._rank)

    def _scores(
        self, turn: str, has_history: bool, *, weak: bool = True
    ) -> tuple[dict[str, float], list[str]]:
        cues: dict[str, float] = {}
        reasons: list[str] = []
        # Text pasted after a colon, quoted or fenced is material to work on, not the user's
        # own words.
        material = _MATERIAL.search(turn)
        instruction = turn[: material.start()] if material else turn
        quoted = _QUOTED.search(instruction)
        if quoted:
            instruction = _QUOTED.sub(" ", instruction)
        for label in self._compiled:
            hits = label.hits(instruction)
            if hits:
                cues[label.name] = label.weight * len(hits)
                reasons.append(f"{label.name}: {', '.join(repr(h) for h in hits[:3])}")
        if not has_history:
            cues.pop(FOLLOW_UP, None)  # nothing earlier to refer to
        scores = dict(cues)
        self._structure(
            turn, instruction, has_history, bool(material or quoted), cues, scores, reasons, weak
        )
        return scores, reasons

    def _structure(
        self,
        turn: str,
        instruction: str,
        has_history: bool,
        brings_material: bool,
        cues: dict[str, float],
        scores: dict[str, float],
        reasons: list[str],
        weak: bool,
    ) -> None:
        """The cues that are not words: punctuation, sentence shape, length, pasted data, and
        the conversation so far."""
        labels = self.labels
        words = _WORD.findall(turn)
        if "task" in labels and _ASKS_YOU_TO.search(instruction):
            # "could you shorten this?": a request, however politely asked.
            scores["task"] = scores.get("task", 0.0) + 2.0
            reasons.append("asks the assistant to do something")
        elif "question" in labels and turn.endswith("?"):
            scores["question"] = scores.get("question", 0.0) + 1.0
            reasons.append("ends with '?'")
        edit = _EDIT.match(instruction)
        if "task" in labels and not edit and _CREATE.match(instruction):
            scores["task"] = scores.get("task", 0.0) + 2.0
            reasons.append("asks for something new")
        if brings_material:
            # The turn brings its own material: not a reference back, and something to do.
            scores.pop(FOLLOW_UP, None)
            cues.pop(FOLLOW_UP, None)
            if "task" in labels and not scores and _WORD.search(instruction):
                scores["task"] = 1.0
                reasons.append("an instruction with material")
        elif has_history and FOLLOW_UP in labels and not any(cues.get(s) for s in _SOCIAL):
            short = len(words) <= _SHORT_WORDS
            if edit:
                scores[FOLLOW_UP] = max(scores.values(), default=0.0) + 1.0
                reasons.append("changes the answer")
            elif short and _REFERENCE.search(turn):
                scores[FOLLOW_UP] = scores.get(FOLLOW_UP, 0.0) + 3.0
                reasons.append("short and refers back")
            elif len(words) <= _CONNECTED_WORDS and _CONNECTOR.match(turn):
                scores[FOLLOW_UP] = scores.get(FOLLOW_UP, 0.0) + 3.0
                reasons.append("short and continues the conversation")
            elif (
                turn.endswith("?")
                and len(words) <= _ELLIPTICAL_WORDS
                and not cues.get("question")
                and not _QUESTION_OPENER.match(turn)
            ):
                scores[FOLLOW_UP] = scores.get(FOLLOW_UP, 0.0) + 2.5
                reasons.append("an elliptical question")
        if "chitchat" in labels and not cues.get("task") and not cues.get("feedback"):
            # Small talk by its shape: a social question to the assistant about itself (not
            # about what it can do), or how the user feels, with nothing asked for.
            shape = _ABOUT_YOU.search(turn) or _FEELING.search(turn)
            if shape:
                scores["chitchat"] = scores.get("chitchat", 0.0) + 2.5
                reasons.append("small talk: " + repr(shape.group(0)[:30]))
            elif weak and not scores and turn.endswith("!"):
                scores["chitchat"] = 1.0
                reasons.append("an exclamation, nothing asked")
            elif weak and not scores and not turn.endswith("?") and _PERSONAL.search(turn):
                scores["chitchat"] = 1.0
                reasons.append("a remark about the user, nothing asked")
        if (
            weak
            and has_history
            and FOLLOW_UP in labels
            and not scores
            and not brings_material
            and 0 < len(words) <= _SHORT_WORDS
        ):
            scores[FOLLOW_UP] = 1.0  # a few words with nothing of their own
            reasons.append("a few words after an answer")
        # A request decides over the thanks or greeting that comes with it.
        social = max(_SOCIAL, key=lambda s: scores.get(s, 0.0))
        request = max(_REQUESTS, key=lambda r: cues.get(r, 0.0))
        if scores.get(social, 0.0) and cues.get(request, 0.0) >= 2.0 and social in labels:
            scores[request] = max(scores.values()) + 0.5
            reasons.append(f"a request ({request}) with {social}")
        if _ACK.match(turn) and "feedback" in labels:
            scores.clear()
            if has_history:
                scores["feedback"] = 2.0
            reasons.append("an acknowledgement")
        elif not words or _DATA.match(turn) or _GIBBERISH.match(turn):
            scores.clear()  # data, a test, or nothing to read: other
            reasons.append("no request to read")


def _opener(turn: str) -> int:
    """Where the thanks, greeting or aside that opens `turn` ends (0 if there is none): words
    of an opener set off by punctuation ("thanks, that helps.", "hi there,"), then perhaps an
    aside ("btw", "quick q -")."""
    end = position = 0
    for _ in range(_OPENER_STEPS):
        step = _OPENER_STEP.match(turn, position)
        if not step:
            break
        position = step.end()
        if step.group(1):
            end = position
    aside = _ASIDE_STEP.match(turn, end)
    return aside.end() if aside else end


def _best(scores: Mapping[str, float], rank: Mapping[str, int]) -> str | None:
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], rank.get(kv[0], 0)))
    return ranked[0][0] if ranked and ranked[0][1] > 0 else None


def _result(scores: dict[str, float], reasons: list[str], rank: Mapping[str, int]) -> Intent:
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], rank.get(kv[0], 0)))
    if not ranked or ranked[0][1] <= 0:
        return Intent(OTHER, 0.3, "keyword", reasoning="no cue matched")
    (best, top), runner = ranked[0], ranked[1] if len(ranked) > 1 else (None, 0.0)
    margin = top - runner[1]
    confidence = round(min(0.95, 0.5 + 0.15 * margin + 0.05 * top), 2)
    ambiguous = margin < 0.5
    return Intent(
        best,
        confidence,
        "keyword",
        reasoning="; ".join(reasons)[:300],
        is_ambiguous=ambiguous,
        alternative_label=runner[0] if ambiguous or runner[1] > 0 else None,
    )
