"""Tree of thought: fork the state into several branches that run concurrently, then let the
model judge them and pick the best one.

    .venv/bin/python examples/dsl_tree_of_thought.py
"""

from __future__ import annotations

from _backend import default_backend

import plait


@plait.function
def tree_of_thought(s, question, branches=3):
    s += plait.user(question + " Think step by step.")
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += plait.assistant(plait.gen("thought", max_tokens=48, temperature=0.8, seed=i, stop="\n\n"))
    forks.join()  # s["thought"] is the list of the branches' thoughts
    s += plait.user(
        "Here are some answers:\n"
        + "\n".join(f"({i + 1}) {t.strip()}" for i, t in enumerate(s["thought"]))
        + "\nWhich one is best?"
    )
    s += plait.assistant(
        "The best answer is (" + plait.select("best", choices=[str(i + 1) for i in range(branches)]) + ")"
    )


def main() -> None:
    with default_backend(__doc__):
        state = tree_of_thought.run(question="How can I get better at chess?")
        for i, thought in enumerate(state["thought"]):
            print(f"branch {i + 1}: {thought.strip()}\n")
        print("best:", state["best"])


if __name__ == "__main__":
    main()
