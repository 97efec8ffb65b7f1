"""Prompts of a copying task ("repeat this passage word for word"), for speculative-decoding benchmarks.

A model that does what such a prompt asks emits text that already occurs in its context, which is where n-gram
prompt lookup proposes well; random-token prompts are the opposite case. The passages are built from the
sentences below (written for this benchmark), shuffled per prompt with a seed so that no two prompts share a
prefix past the instruction (the prefix cache does not help the later runs).
"""

from __future__ import annotations

import random
from typing import Any

_SENTENCES = (
    "The river bends twice before it reaches the old mill, and each bend hides a small beach of grey stones.",
    "Every morning the baker opens the shutters at six and sets the first loaves on the wooden rack by the door.",
    "A lighthouse keeper once counted the ships that passed in a year and wrote the number on the kitchen wall.",
    "The library keeps its maps in long flat drawers, sorted by coast and then by the year they were drawn.",
    "When the wind turns to the north the harbour fills with fishing boats waiting for calmer water.",
    "She planted tomatoes along the fence, beans by the shed, and a single sunflower in the middle of the lawn.",
    "The train to the mountains leaves at noon and climbs through three tunnels before the first station.",
    "In the workshop every tool hangs on a painted outline, so a missing chisel is noticed at once.",
    "The committee met on Tuesday, agreed on the budget, and postponed the question of the new bridge.",
    "Snow fell through the night and by morning the road to the village had disappeared under it.",
    "He repaired the clock by replacing one worn gear and cleaning forty years of dust from the rest.",
    "The market sells apples from the valley, cheese from the hills, and fish that arrived before dawn.",
    "A good recipe lists the ingredients in the order they are used and says how long each step takes.",
    "The museum guard knows the story of every painting in the east wing and tells it to anyone who asks.",
    "At the end of the pier there is a bench where the same three friends play cards every Sunday.",
    "The school bell rang late that day because the caretaker had gone to help a neighbour move a piano.",
    "Our cat sleeps on the warmest chair in the house and moves with the sun from room to room.",
    "The bridge was painted green in the spring, and by autumn the paint had faded to the colour of moss.",
    "Two hundred volunteers cleaned the beach in one afternoon and filled sixty bags with plastic.",
    "The letter arrived a week late, folded twice, with a pressed flower between the pages.",
    "On clear nights the observatory opens its dome and visitors take turns at the big telescope.",
    "The carpenter measured the doorway three times before he cut the first board for the new frame.",
    "A narrow path climbs from the church to the castle ruins, and goats graze along the way.",
    "The orchestra tuned for ten minutes while the audience found their seats and folded their coats.",
)

INSTRUCTION = "Repeat the following text exactly, word for word, and write nothing else:\n\n"


def quote_prompts(tokenizer: Any, num_prompts: int, input_len: int, *, seed: int) -> list[list[int]]:
    """``num_prompts`` token-id prompts of about ``input_len`` tokens that ask to repeat a passage.

    The passage grows sentence by sentence until the prompt (chat template applied when the tokenizer has one)
    reaches ``input_len`` tokens; it is never cut mid-sentence, so prompts may be a sentence longer.

    Raises:
        ValueError: ``num_prompts`` or ``input_len`` below 1.
    """
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"quote prompts: need at least one prompt of at least one token, got {num_prompts} x {input_len}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        order = list(_SENTENCES)
        rng.shuffle(order)
        passage: list[str] = []
        ids: list[int] = []
        while len(ids) < input_len:
            passage.append(order[len(passage) % len(order)])
            ids = _encode(tokenizer, INSTRUCTION + " ".join(passage))
        prompts.append(ids)
    return prompts


def _encode(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]
