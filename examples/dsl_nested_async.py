"""Programs that call programs, run from asyncio.

`s += ask(...)` runs `ask` on the caller's state (its text continues the conversation, the
variables it sets are the caller's); `expand(tip=...)` not appended is a program of its own, and
several of those run concurrently (SGLang's multi-function programs). `await prog.run_async(...)`
and `async for piece in state.text_async_iter()` never block the event loop.

    .venv/bin/python examples/dsl_nested_async.py
"""

from __future__ import annotations

import asyncio

from _backend import default_backend

import plait


@plait.function
def ask(s, question, var):
    s += plait.user(question)
    s += plait.assistant(plait.gen(var, max_tokens=32, stop="\n"))


@plait.function
def expand(s, tip):
    s += plait.user("Explain this tip in one sentence: " + tip)
    s += plait.assistant(plait.gen("detail", max_tokens=32, stop="\n"))


@plait.function
def travel(s, city):
    s += plait.system("You are a concise travel guide.")
    s += ask(f"Name one thing to see in {city}.", "sight")  # inline: same conversation
    s += ask("And one dish to try there?", "dish")
    tips = [expand(tip=f"visit {s['sight']}"), expand(tip=f"try {s['dish']}")]  # programs of their own
    s += plait.user("Summarize in one line.")
    s += plait.assistant(plait.gen("summary", max_tokens=32, stop="\n"))
    s["details"] = [t["detail"] for t in tips]


async def main() -> None:
    with default_backend(__doc__):
        # two programs at once, awaited without blocking the loop
        paris, rome = await asyncio.gather(
            travel.run_async(city="Paris", temperature=0), travel.run_async(city="Rome", temperature=0)
        )
        for name, st in (("Paris", paris), ("Rome", rome)):
            print(f"{name}: sight={st['sight']!r} dish={st['dish']!r}\n  details={st['details']}")
        # streaming into the event loop
        st = await travel.run_async(city="Lisbon", temperature=0, stream=True)
        async for piece in st.text_async_iter("summary"):
            print(piece, end="", flush=True)
        print()


if __name__ == "__main__":
    asyncio.run(main())
