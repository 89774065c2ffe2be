"""The intent labels: what each means (for the LLM classifier) and the keyword classifier's cues
for the default set (question, task, follow_up, feedback, chitchat, other). Data, tuned on the
`dev` rows of tests/data/intent_eval.jsonl and the first half (t001-t120) of
tests/data/intent_tune.jsonl only, the second half being the check (bench/intent_eval.py)."""

from __future__ import annotations

from dataclasses import dataclass

OTHER = "other"
FOLLOW_UP = "follow_up"


@dataclass(frozen=True, slots=True)
class LabelSpec:
    """A label as a tenant configures it: what it means (for the LLM) and its cues."""

    description: str
    keywords: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    weight: float = 1.0  # what each matching cue adds to the label's score


# Verbs that ask for something to be produced or changed, when they open a turn (or follow
# "please", "can you", "could you"...).
TASK_VERBS = (
    "write|rewrite|draft|compose|create|generate|make|build|fix|debug|refactor|translate|"
    "summari[sz]e|sum up|rephrase|paraphrase|convert|list|plan|design|edit|correct|improve|"
    "format|outline|produce|prepare|code|implement|add|remove|change|update|shorten|expand|"
    "proofread|polish|reword|turn|put|give|suggest|recommend|come up with|brainstorm|"
    "calculate|compute|sort|organi[sz]e|extract|classify|compare|review|check|optimi[sz]e|"
    "simplify|draw|sketch|schedule|book|find|send|set up|setup|respond|reply|show me|"
    "help me (?:write|with|make|plan|draft)"
)
_POLITE = r"(?:please |pls |kindly |can you |could you |would you |will you |can u |could u )"
# What a verdict on an answer calls it.
_VERDICTS = (
    r"good|great|bad|wrong|right|correct|incorrect|perfect|awesome|amazing|useless|helpful|"
    r"useful|unhelpful|brilliant|excellent|fantastic|wonderful|lovely|beautiful|cute|funny|"
    r"hilarious|clever|genius|boring|bland|generic|vague|confusing|clear|terrible|awful|"
    r"horrible|fine|not bad|spot on|exactly|solid|impressive|garbage|nonsense|inaccurate|"
    r"outdated|lame|cringe|cheesy|robotic|stiff|off|weird|too \w+|not (?:it|right|what)"
)
# Things a task produces, when asked for by name.
_DELIVERABLES = (
    r"\b(?:blog post|essay|e-?mail|cover letter|poem|haiku|limerick|story|tweet|slogan|"
    r"script|regex|sql query|unit tests?|function that|packing list|checklist|cv|resume|"
    r"invitation|speech|toast|caption|bio|tagline|recipe for|workout plan|itinerary|"
    r"ideas for|names? (?:for|ideas)|\d+[- ]word)\b"
)

DEFAULT_LABELS: dict[str, LabelSpec] = {
    "question": LabelSpec(
        "Asks for information, an explanation or an opinion.",
        keywords=(
            "explain",
            "tell me",
            "describe",
            "what is",
            "what are",
            "how do",
            "how does",
            "how to",
            "how can i",
            "how would",
            "why is",
            "why do",
            "why does",
            "difference between",
            "i wonder",
            "wondering",
            "curious",
            "is it true",
            "meaning of",
            "definition of",
            "walk me through",
            "help me understand",
            "should i",
            "is there",
            "are there",
            "can i",
            "in what",
            "qu'est-ce",
            "pourquoi",
            "cómo",
            "qué es",
            "por qué",
            "was ist",
            "warum",
            "wie viel",
        ),
        patterns=(
            r"^(?:what|whats|what's|who|whom|whose|when|where|which|why|how|is|are|was|were|"
            r"does|do|did|can|could|should|would|will|has|have|had|am|isn't|aren't|doesn't|"
            r"quel|quelle|est-ce|qui|quand|où|es|son|quién|cuándo|dónde|ist|sind|wer|"
            r"wann|wo|welche)\b(?!'t\b)",
            r"^(?:explain|describe|define|tell me|name)\b",
        ),
    ),
    "task": LabelSpec(
        "Asks the assistant to produce or change something: write, fix, translate, summarise.",
        keywords=(
            "i need a",
            "i need an",
            "need a",
            "need an",
            "help me",
            "i want you to",
            "show me the code",
            "traduis",
            "écris",
            "rédige",
            "résume",
            "traduce",
            "escribe",
            "escríbeme",
            "übersetze",
            "übersetzen",
            "schreib",
            "schreiben",
            "erstelle",
            "fasse",
        ),
        patterns=(
            rf"^{_POLITE}?(?:{TASK_VERBS})\b",
            rf"\b(?:can|could|would|will) (?:you|u) (?:please |also |just )?(?:{TASK_VERBS})\b",
            r"\b(?:translate|summari[sz]e|rewrite|proofread)\b",
            rf"^(?:now|then|next|also|and now|ok now|okay now)[, ]+(?:please )?(?:{TASK_VERBS})\b",
            _DELIVERABLES,
        ),
        weight=1.5,
    ),
    FOLLOW_UP: LabelSpec(
        "Refers to earlier turns and only makes sense with them: 'the first one', 'do that "
        "again', 'make it shorter', 'what about X?', 'why?'.",
        keywords=(
            "the first one",
            "the second one",
            "the last one",
            "the previous",
            "the other one",
            "do that again",
            "try again",
            "same thing",
            "one more",
            "another one",
            "what about",
            "how about",
            "why not",
            "you mentioned",
            "as you said",
            "like before",
            "instead",
            "the above",
            "what if",
            "from above",
            "that one",
            "tell me more",
            "more detail",
            "more details",
            "an example",
            "give an example",
            "give me an example",
            "say it",
            "more simply",
            "does that mean",
            "so that means",
            "you mean",
            "go on",
            "keep going",
            "et en",
            "y en",
            "und auf",
        ),
        patterns=(
            r"\b(?:it|that|this|them|those|these|one)\b.{0,60}\b(?:shorter|longer|simpler|more|"
            r"less|better|again|formal|casual|funnier|clearer)\b",
            r"\b(?:shorter|longer|simpler|more detail|less formal|more formal|again)\b",
            r"^(?:more|less|continue)\b",
            r"\bi (?:still )?(?:don't|do not|didn't|did not) (?:get|understand|follow)\b",
            r"\b(?:explain|say|put|describe|show) (?:it|that|this) (?:again|differently|"
            r"(?:in )?(?:a |an )?(?:different|other|another|simpler) (?:way|words|terms))\b",
            r"^(?:why|how so|really|which one|what else|any other|example|examples)\W*$",
            r"\b(?:first|second|third|last|previous|next) (?:one|option|point|step|idea|"
            r"example|version|paragraph|item)\b",
            r"\b(?:now|also|then|next) (?:add|make|do|change|remove|put|write|translate|turn|"
            r"try|give|show|include|use|convert|rewrite)\b",
            r"^(?:and |now |ok )?(?:in|en|auf|em) (?:english|french|spanish|german|italian|"
            r"portuguese|español|francés|inglés|français|anglais|deutsch|englisch|französisch)\b",
        ),
        weight=2.0,
    ),
    "feedback": LabelSpec(
        "Thanks, praise, complaints, or corrections of the assistant.",
        keywords=(
            "thank you",
            "thanks",
            "thx",
            "ty",
            "cheers",
            "great job",
            "well done",
            "perfect",
            "awesome",
            "amazing",
            "helpful",
            "super clear",
            "very clear",
            "not helpful",
            "that's wrong",
            "thats wrong",
            "that is wrong",
            "was wrong",
            "you're wrong",
            "youre wrong",
            "incorrect",
            "not correct",
            "not right",
            "that's not",
            "thats not",
            "doesn't work",
            "didn't work",
            "does not work",
            "did not work",
            "not working",
            "still getting",
            "still not",
            "same error",
            "keep giving",
            "you keep",
            "you made a",
            "mistake",
            "wrong answer",
            "not what i asked",
            "not what i meant",
            "i said",
            "i asked for",
            "you said",
            "you gave me",
            "way too",
            "too long",
            "too short",
            "useless",
            "good bot",
            "bad bot",
            "merci",
            "gracias",
            "danke",
            "parfait",
            "love it",
            "nice one",
            "good answer",
            "bad answer",
            "you missed",
            "you forgot",
            "that worked",
            "it worked",
            "works now",
            "runs now",
            "genau das",
            "exactly what",
            "spot on",
            "you're right",
            "youre right",
            "you are right",
            "fair enough",
            "makes sense",
            "doesn't make sense",
            "does not make sense",
            "confusing",
            "not accurate",
            "inaccurate",
            "outdated",
            "made that up",
            "made up",
            "broken",
            "still wrong",
            "wrong again",
            "lifesaver",
            "life saver",
            "you rock",
            "legend",
            "appreciate it",
            "much appreciated",
            "that helps",
            "that helped",
            "this helps",
            "this helped",
            "not bad",
            "good job",
            "nailed it",
            "love this",
            "love that",
            "ignored",
            "are you sure",
            "useful",
            "keep it up",
            "wtf",
            "didn't ask",
            "did not ask",
            "grazie",
            "vielen dank",
            "muchas gracias",
        ),
        patterns=(
            r"^(?:great|perfect|awesome|excellent|nice|cool|wonderful|brilliant|thanks|"
            r"thank you|wrong|nope|not quite|close but|wow|meh)\b(?! to meet)",
            r"\b(?:doesn't|does not|didn't|did not|won't|will not|still doesn't|can't) (?:even |"
            r"actually )?(?:compile|run|build|load|start|install|work)\b",
            r"\b(?:that|this|the|your) (?:\w+ )?(?:script|code|fix|command|query|function|"
            r"answer|solution|advice|suggestion|formula|recipe) (?:\w+ )?(?:deleted|broke|"
            r"crashed|failed|ruined|wiped|is wrong|was wrong)\b",
            # A verdict on what the assistant gave ("that's way too generic", "this looks
            # great", "it works now", "doesn't look right", "still broken").
            rf"^(?:(?:ok|okay|hmm+|haha|lol|wow|yeah|yes|no|nah|ugh|honestly)[, ]+)?(?:that|this|"
            rf"it|these|those)(?:'s| is| was| looks| sounds| seems| reads| feels)? (?:\w+ )?"
            rf"(?:{_VERDICTS})\b",
            r"^(?:(?:ok|okay|yes|yay|great|nice|cool)[, ]+)?(?:that|this|it) (?:\w+ )?(?:works|"
            r"worked|fixed it|did the trick|solved it)\b",
            r"\b(?:doesn't|does not|didn't|did not|don't|do not) (?:seem|look|sound|read|feel) "
            r"(?:\w+ )?(?:right|correct|good|great|accurate|true)\b|\b(?:that|this|it) can't be "
            r"right\b|\bi don't think (?:that's|that is|this is|it's|it is|you're) "
            r"(?:right|correct|true|accurate)\b",
            r"\bstill (?:\w+ )?(?:wrong|broken|throws|fails|failing|crashes|crashing|errors|"
            r"erroring|the same)\b",
            r"\b(?:you're|you are|youre|ur) (?:so |really |the |a )?(?:best|smart|genius|"
            r"great|amazing|awesome|helpful|wrong|useless|brilliant|star|hero)\b",
            r"^(?:no|nope|nah)\s*[,.!]",
        ),
        weight=2.0,
    ),
    "chitchat": LabelSpec(
        "Greetings, small talk and social remarks.",
        keywords=(
            "how are you",
            "how's it going",
            "hows it going",
            "how are things",
            "what's up",
            "whats up",
            "good morning",
            "good night",
            "good evening",
            "good afternoon",
            "nice to meet you",
            "see you",
            "bye",
            "goodbye",
            "lol",
            "lmao",
            "i'm bored",
            "im bored",
            "how's your day",
            "hows your day",
            "how was your day",
            "your favourite",
            "your favorite",
            "do you like",
            "anyone there",
            "to an ai",
            "are you an ai",
            "are you a bot",
            "are you human",
            "who are you",
            "your name",
            "you too",
            "mondays",
            "bonjour",
            "salut",
            "hola",
            "qué tal",
            "buenos días",
            "buenas",
            "hallo",
            "guten tag",
            "guten abend",
            "guten morgen",
            "ça va",
            "ciao",
            "buongiorno",
            "buonasera",
            "how have you been",
            "long time no see",
            "what are you up to",
            "how do you feel",
            "do you have feelings",
            "are you happy",
            "are you real",
            "i'm tired",
            "im tired",
            "i'm sad",
            "im sad",
            "i'm happy",
            "feeling down",
            "feeling great",
            "what a day",
            "long day",
            "rough day",
            "have a good weekend",
            "have a nice weekend",
            "have a great weekend",
            "brb",
            "see ya",
            "gtg",
            "wie geht",
            "tudo bem",
            "como vai",
            "come stai",
            "come va",
            "cómo estás",
            "comment vas-tu",
            "comment ça va",
            "tgif",
            "can't sleep",
            "cant sleep",
            "just wanted to say hi",
            "just saying hi",
            "you're funny",
            "youre funny",
            "love you",
            "miss you",
            "talk later",
            "gotta go",
            "sweet dreams",
            "cya",
            "ttyl",
            "what's new",
            "whats new",
            "nothing much",
        ),
        patterns=(
            r"^(?:hi+|hey+|hel+o+|heya|hiya|yo|howdy|sup|greetings|morning|evening|gm|gn)\b"
            r"[\s!.,?]*(?:there|again|everyone|all|friend|buddy)?[\s!.,?]*\W*$",
            r"^(?:ha){2,}h?\b",
            # A wish opens the turn it makes ("happy friday!!", "merry christmas to you too").
            r"^(?:happy|merry) (?:friday|christmas|xmas|new year|holidays|birthday|easter|"
            r"thanksgiving|weekend|monday|diwali|hanukkah)\b",
            # The weather right now.
            r"^it'?s (?:\w+ )?(?:raining|snowing|pouring|freezing|so hot|so cold|boiling)\b",
        ),
        weight=2.0,
    ),
    OTHER: LabelSpec("None of the above: unclear, unrelated or empty."),
}
