"""Few-shot question answering: a constant prefix of examples (shared in the radix cache), then gen.

.venv/bin/python examples/dsl_few_shot_qa.py
"""

from __future__ import annotations

from _backend import default_backend

import plait

EXAMPLES = [
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
]


@plait.function
def few_shot_qa(s, question):
    s += "Answer each question with one word.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + plait.gen("answer", max_tokens=8, stop="\n")


def main() -> None:
    with default_backend(__doc__):
        for question in ("What is the capital of France?", "What is the capital of Spain?"):
            state = few_shot_qa.run(question=question, temperature=0)
            meta = state.get_meta_info("answer")
            print(f"{question} -> {state['answer'].strip()!r}  (cached prompt tokens: {meta['cached_tokens']})")


if __name__ == "__main__":
    main()
