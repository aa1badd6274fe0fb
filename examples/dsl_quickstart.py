"""Quick start for the DSL: a program with a system prompt, two chat turns and a select.

.venv/bin/python examples/dsl_quickstart.py            # in-process engine, default model
.venv/bin/python examples/dsl_quickstart.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

from _backend import default_backend

import plait


@plait.function
def quickstart(s, question):
    s += plait.system("You are a helpful assistant. Answer briefly.")
    s += plait.user(question)
    s += plait.assistant(plait.gen("answer", max_tokens=48, stop="\n\n"))
    s += plait.user("Is your answer correct? Answer yes or no.")
    s += plait.assistant(plait.select("verdict", choices=["yes", "no"]))


def main() -> None:
    with default_backend(__doc__):
        state = quickstart.run(question="What is the capital of France?", temperature=0)
        print("answer: ", state["answer"].strip())
        print("verdict:", state["verdict"])
        print("\n--- the whole text ---\n" + state.text())


if __name__ == "__main__":
    main()
