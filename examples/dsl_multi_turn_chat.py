"""Multi-turn chat with the model's own chat template: role calls and `with s.user():` blocks.

.venv/bin/python examples/dsl_multi_turn_chat.py
"""

from __future__ import annotations

from _backend import default_backend

import plait


@plait.function
def multi_turn(s, questions):
    s += plait.system("You are a helpful assistant. Answer in one sentence.")
    for i, q in enumerate(questions):
        with s.user():
            s += q
        with s.assistant():
            s += plait.gen(f"answer_{i}", max_tokens=48)


def main() -> None:
    with default_backend(__doc__):
        questions = [
            "What is the capital of France?",
            "And what river flows through it?",
            "Name a famous museum there.",
        ]
        state = multi_turn.run(questions=questions, temperature=0)
        for m in state.messages():
            print(f"{m['role']:>9}: {m['content'].strip()}")


if __name__ == "__main__":
    main()
