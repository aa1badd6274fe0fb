"""Streaming: `run(stream=True)` returns at once; `text_iter()` yields the text as it is made
(`text_iter("name")` only that variable's pieces).

    .venv/bin/python examples/dsl_streaming.py
"""

from __future__ import annotations

from _backend import default_backend

import plait


@plait.function
def story(s, topic):
    s += plait.user(f"Write a short story about {topic}.")
    s += plait.assistant(plait.gen("story", max_tokens=96))


def main() -> None:
    with default_backend(__doc__):
        state = story.run(topic="a lighthouse keeper", stream=True, temperature=0.7, seed=0)
        for piece in state.text_iter("story"):
            print(piece, end="", flush=True)
        print()


if __name__ == "__main__":
    main()
