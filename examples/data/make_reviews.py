"""Generate `reviews.csv`: short product/service reviews labelled positive (1) or negative (0).

    python examples/data/make_reviews.py [--n 480 --seed 0]

Where the data comes from: nothing is downloaded or copied. Each sentence is assembled from
the word lists below (written for this repo) by a seeded random generator, so the file is
reproducible bit for bit and carries no licence of a third-party corpus. About a fifth of
the sentences use negation ("was not great", "is not bad at all") so that the task cannot be
solved by spotting single words; a sentence-embedding model needs a little fine-tuning to
get them right. `reviews.csv` in this folder is the output with the default arguments.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

SUBJECTS = [
    "the battery",
    "the screen",
    "the delivery",
    "the customer service",
    "the pasta",
    "the hotel room",
    "the movie",
    "the soundtrack",
    "the keyboard",
    "the camera",
    "the coffee",
    "the checkout process",
    "the app",
    "the headphones",
    "the staff",
    "the book",
    "the mattress",
    "the update",
    "the flight",
    "the tutorial",
    "the charger",
    "the pizza",
    "the game",
    "the vacuum cleaner",
]
POSITIVE = [
    "great",
    "excellent",
    "wonderful",
    "reliable",
    "fantastic",
    "delightful",
    "superb",
    "impressive",
    "comfortable",
    "fast",
    "friendly",
    "helpful",
    "lovely",
    "solid",
    "brilliant",
    "smooth",
]
NEGATIVE = [
    "terrible",
    "awful",
    "disappointing",
    "unreliable",
    "horrible",
    "broken",
    "slow",
    "rude",
    "useless",
    "noisy",
    "flimsy",
    "frustrating",
    "mediocre",
    "overpriced",
    "boring",
    "buggy",
]
PLAIN = [
    "{s} was {a}.",
    "{s} is {a}.",
    "honestly, {s} was {a}.",
    "i think {s} is {a}.",
    "{s} turned out to be {a}.",
    "overall {s} felt {a}.",
    "{s} was really {a} this time.",
]
NEGATED = ["{s} was not {a}.", "{s} is not {a} at all.", "i would not call {s} {a}.", "{s} was never {a}."]
ENDINGS = ["", "", " Would buy again.", " Would not recommend.", " Five stars.", " One star."]


def sentence(rng: random.Random) -> tuple[str, int]:
    """One review and its label; the ending must agree with the label (else it is dropped)."""
    label = rng.randrange(2)
    negated = rng.random() < 0.2
    # A negated positive word reads negative, and vice versa.
    word_positive = (label == 1) != negated
    adjective = rng.choice(POSITIVE if word_positive else NEGATIVE)
    template = rng.choice(NEGATED if negated else PLAIN)
    ending = rng.choice(ENDINGS)
    if (label == 1 and ending in (" Would not recommend.", " One star.")) or (
        label == 0 and ending in (" Would buy again.", " Five stars.")
    ):
        ending = ""
    text = template.format(s=rng.choice(SUBJECTS), a=adjective) + ending
    return text[0].upper() + text[1:], label


def generate(n: int, seed: int) -> list[tuple[str, int]]:
    """`n` distinct labelled sentences."""
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    while len(seen) < n:
        text, label = sentence(rng)
        seen.setdefault(text, label)
    return list(seen.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=480)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("reviews.csv"))
    args = parser.parse_args()
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(generate(args.n, args.seed))
    print(f"wrote {args.n} sentences to {args.out}")


if __name__ == "__main__":
    main()
