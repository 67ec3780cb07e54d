"""Tasks and reward of the echo agent example: give back one word, in exactly the form the question asks for.

A task is a request such as "Repeat this word: lantern. Reply with only that word." The reply succeeds when,
stripped of surrounding spaces, quotes and one final period and lowercased, it is exactly the word: the task states
the required form, and the check is that form, nothing looser ("The word is lantern." fails).

SmolLM2-135M-Instruct finds the word (it is in most of its replies) but mostly wraps it in a sentence ('The word
"wolf" is repeated.'), so it starts low (~10% greedy) and RL can teach it the form within minutes on a CPU.

Train and held-out tasks are disjoint by their word: a word is a held-out word or a train word by a stable hash, so
no held-out word is ever asked for in training.

Run ``python examples/pick_agent/tasks.py OUT_DIR`` to write ``train.jsonl`` and ``heldout.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

_WORDS = (
    "apple banana mango cherry grape lemon peach pear plum orange melon kiwi lime apricot papaya fig coconut "
    "strawberry pineapple blueberry dog cat horse tiger lion rabbit mouse cow sheep goat zebra monkey bear wolf fox "
    "deer camel elephant giraffe donkey red blue green yellow purple pink brown black white gray violet crimson "
    "turquoise maroon beige indigo magenta teal navy scarlet car bus truck train bicycle motorcycle boat ship "
    "airplane helicopter tractor van taxi scooter tram submarine canoe yacht jeep ambulance chair table sofa bed "
    "desk shelf stool bench cabinet dresser wardrobe couch bookcase armchair cupboard ottoman crib hammock futon "
    "recliner piano guitar violin drum flute trumpet harp cello saxophone clarinet banjo trombone ukulele accordion "
    "harmonica oboe tuba xylophone mandolin bagpipes river mountain forest desert island valley ocean lake meadow "
    "canyon glacier volcano window garden kitchen ladder bottle pencil blanket candle mirror basket hammer "
    "umbrella lantern compass anchor feather marble pillow carpet teapot wallet rocket castle bridge tunnel "
    "harbor village market library museum theater stadium temple tower fountain"
)
WORDS: list[str] = _WORDS.split()

QUESTIONS = [
    "Repeat this word: {word}. Reply with only that word.",
    "Say the word {word}. Reply with only that word.",
    "Copy this word exactly: {word}. Reply with only the word.",
    "Please echo the word '{word}'. Reply with nothing but the word.",
    "Write the word {word} back to me, and nothing else.",
]


def split_of(word: str) -> str:
    """The split whose tasks may ask for ``word`` (~20% of the words are held-out words)."""
    digest = hashlib.sha256(word.encode()).digest()
    return "heldout" if digest[0] < 52 else "train"


def tasks_of(split: str, seed: int) -> list[dict[str, Any]]:
    """Every task of ``split`` (each of its words with each phrasing), in a seeded order: ``{"question", "answer"}``."""
    out = [
        {"question": question.format(word=word), "answer": word}
        for word in WORDS
        if split_of(word) == split
        for question in QUESTIONS
    ]
    random.Random(seed).shuffle(out)
    return out


def normalize(reply: str) -> str:
    """The reply as the check reads it: surrounding spaces and quotes off, one final period off, lowercased."""
    text = reply.strip().strip("\"'`*").strip()
    if text.endswith("."):
        text = text[:-1]
    return text.strip().lower()


def reward(task: dict[str, Any], reply: str | None) -> float:
    """1.0 when the reply is exactly the right word (``normalize``), 0.0 otherwise."""
    return 1.0 if reply is not None and normalize(reply) == task["answer"] else 0.0


def write_all(out_dir: str | Path) -> None:
    """Write train and held-out tasks (JSONL)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_tasks()), ("heldout", heldout_tasks())):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


# -- sources named by train.toml (called with no arguments) -----------------------------------------------------------
def train_tasks() -> list[dict[str, Any]]:
    return tasks_of("train", seed=1)


def heldout_tasks() -> list[dict[str, Any]]:
    return tasks_of("heldout", seed=2)


if __name__ == "__main__":
    write_all(sys.argv[1] if len(sys.argv) > 1 else ".")
