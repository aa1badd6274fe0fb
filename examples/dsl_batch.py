"""A batch of 100 programs run concurrently, with a progress bar; they share the prompt prefix
through the radix cache and the engine batches their calls.

    .venv/bin/python examples/dsl_batch.py
"""

from __future__ import annotations

import time

from _backend import default_backend

import plait

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "China", "India", "Brazil", "Canada", "Egypt"]


@plait.function
def capital(s, country, n):
    s += plait.system("You answer geography questions with a single word.")
    s += plait.user(f"What is the capital of {country}? (question {n})")
    s += plait.assistant(plait.gen("answer", max_tokens=8, stop=["\n", "."]))


def main() -> None:
    with default_backend(__doc__):
        args = [{"country": COUNTRIES[i % len(COUNTRIES)], "n": i} for i in range(100)]
        t = time.perf_counter()
        states = capital.run_batch(args, temperature=0, num_threads=32, progress_bar=True)
        print(f"100 programs in {time.perf_counter() - t:.1f} s")
        for a, st in list(zip(args, states))[:10]:
            print(f"{a['country']:>8}: {st['answer'].strip() if st.error() is None else st.error()}")
        failed = sum(st.error() is not None for st in states)
        print("failed:", failed)


if __name__ == "__main__":
    main()
