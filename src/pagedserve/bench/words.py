"""The requests the benchmark client sends, and the words its prompts are made of (bench/dataset.py says why
these words)."""
from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city name team minute idea "
    "kid body back parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education food river green blue red light dark "
    "small large old new good great little long high simple open short clear early late young strong"
).split()
# ShareGPT replies carry text, not token counts; ~4 characters per token is the usual English average.
CHARS_PER_TOKEN = 4


class DatasetError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    prompt_len: int   # estimated prompt tokens (words); the server's usage count replaces it when sent
    output_len: int   # max_tokens sent with the request


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))
