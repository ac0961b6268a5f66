"""Generate the small English-like corpus that `examples/tiny-gpt.sx` trains on.

Nothing is downloaded: sentences come from a small grammar and word lists
written here, drawn with a self-contained PRNG (splitmix64) so the output is
byte-identical on every Python version and platform. Running

    python examples/data/make_corpus.py

rewrites `corpus.txt` (the whole text), `train.u16` and `val.u16` (its bytes
as little-endian uint16 tokens, vocabulary 256; the last tenth of the
paragraphs is the validation split) beside this script. The committed files
are this script's output; a test checks they still match.
"""

from __future__ import annotations

import sys
from pathlib import Path

SEED = 20240611
TARGET_BYTES = 320_000
VALIDATION_FRACTION = 0.1
MASK64 = (1 << 64) - 1


class SplitMix64:
    """A tiny deterministic PRNG: the same stream everywhere, unlike `random`'s helpers."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next_u64() % n

    def choice(self, items: list[str]) -> str:
        return items[self.below(len(items))]

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent


NAMES = ["Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Iris", "Jonas",
         "Kira", "Leo", "Maya", "Nils", "Olga", "Pablo", "Rosa", "Sven", "Tara", "Victor"]
ANIMATE = ["farmer", "teacher", "sailor", "baker", "child", "doctor", "painter", "soldier", "merchant",
           "fox", "dog", "cat", "horse", "bird", "wolf", "student", "king", "queen", "stranger", "miller"]
THINGS = ["river", "garden", "house", "letter", "bridge", "forest", "market", "lamp", "window", "road",
          "book", "song", "boat", "mountain", "village", "door", "table", "field", "storm", "clock"]
ADJECTIVES = ["old", "young", "quiet", "bright", "small", "tall", "green", "cold", "warm", "dark",
              "gentle", "strange", "happy", "tired", "brave", "careful", "golden", "distant", "empty", "heavy"]
TRANSITIVE = [("found", "finds"), ("carried", "carries"), ("painted", "paints"), ("watched", "watches"),
              ("opened", "opens"), ("followed", "follows"), ("crossed", "crosses"), ("built", "builds"),
              ("sold", "sells"), ("read", "reads"), ("remembered", "remembers"), ("cleaned", "cleans")]
INTRANSITIVE = [("slept", "sleeps"), ("laughed", "laughs"), ("waited", "waits"), ("sang", "sings"),
                ("walked", "walks"), ("smiled", "smiles"), ("listened", "listens"), ("worked", "works")]
ADVERBS = ["slowly", "quickly", "softly", "happily", "again", "alone", "at last", "every morning",
           "in silence", "without a word"]
PLACES = ["by the river", "in the garden", "near the market", "under the bridge", "at the old house",
          "behind the village", "on the mountain road", "across the field", "inside the forest"]
TIMES = ["In the morning", "At night", "After the storm", "Before winter", "Every summer", "One day",
         "Long ago", "That evening", "On Sunday"]
CONNECTIVES = ["and then", "but", "because", "so", "while"]


class Grammar:
    """Sentences from a small phrase-structure grammar over the word lists above."""

    def __init__(self, rng: SplitMix64) -> None:
        self.rng = rng

    def noun_phrase(self) -> str:
        if self.rng.chance(25):
            return self.rng.choice(NAMES)
        article = "the" if self.rng.chance(60) else "a"
        adjective = self.rng.choice(ADJECTIVES) + " " if self.rng.chance(50) else ""
        noun = self.rng.choice(ANIMATE)
        if article == "a" and (adjective or noun)[0] in "aeiou":
            article = "an"
        return f"{article} {adjective}{noun}"

    def object_phrase(self) -> str:
        article = "the" if self.rng.chance(55) else "a"
        adjective = self.rng.choice(ADJECTIVES) + " " if self.rng.chance(45) else ""
        noun = self.rng.choice(THINGS)
        if article == "a" and (adjective or noun)[0] in "aeiou":
            article = "an"
        return f"{article} {adjective}{noun}"

    def verb_phrase(self, present: bool) -> str:
        tense = 1 if present else 0
        if self.rng.chance(60):
            phrase = f"{self.rng.choice(TRANSITIVE)[tense]} {self.object_phrase()}"
        else:
            phrase = self.rng.choice(INTRANSITIVE)[tense]
        if self.rng.chance(40):
            phrase += " " + self.rng.choice(PLACES)
        if self.rng.chance(30):
            phrase += " " + self.rng.choice(ADVERBS)
        return phrase

    def clause(self, present: bool) -> str:
        return f"{self.noun_phrase()} {self.verb_phrase(present)}"

    def sentence(self) -> str:
        present = self.rng.chance(30)
        text = self.clause(present)
        if self.rng.chance(35):
            text += f" {self.rng.choice(CONNECTIVES)} {self.clause(present)}"
        if self.rng.chance(20):
            text = f"{self.rng.choice(TIMES)}, {text}"
        if self.rng.chance(10):
            return f'"{text[0].upper()}{text[1:]}?" asked {self.rng.choice(NAMES)}.'
        return f"{text[0].upper()}{text[1:]}."

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(3 + self.rng.below(5)))


def generate(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> list[str]:
    """Paragraphs adding up to about `target_bytes` of ASCII text."""
    grammar = Grammar(SplitMix64(seed))
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        paragraph = grammar.paragraph()
        paragraphs.append(paragraph)
        size += len(paragraph) + 1
    return paragraphs


def as_u16_tokens(text: str) -> bytes:
    """Each byte of the text as one little-endian uint16 token."""
    return b"".join(byte.to_bytes(2, "little") for byte in text.encode("ascii"))


def corpus_files(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> dict[str, bytes]:
    """File name → content of the three files this script writes."""
    paragraphs = generate(target_bytes, seed)
    split = len(paragraphs) - max(1, int(len(paragraphs) * VALIDATION_FRACTION))
    train_text = "".join(p + "\n" for p in paragraphs[:split])
    val_text = "".join(p + "\n" for p in paragraphs[split:])
    return {
        "corpus.txt": (train_text + val_text).encode("ascii"),
        "train.u16": as_u16_tokens(train_text),
        "val.u16": as_u16_tokens(val_text),
    }


def main() -> int:
    here = Path(__file__).resolve().parent
    for name, content in corpus_files().items():
        (here / name).write_bytes(content)
        print(f"wrote {here / name} ({len(content)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
