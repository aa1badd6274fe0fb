"""Quick start: generate with plait.Engine on the default model (SmolLM2-135M-Instruct).

python examples/quickstart_engine.py
"""

from __future__ import annotations

import plait


def main() -> None:
    with plait.Engine(model="smollm2") as engine:
        chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        prompt = engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

        out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 32})
        print("answer:", out["text"].strip())
        print("meta:  ", {k: out["meta_info"][k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens")})

        # The same prompt again: its KV comes from the radix cache.
        again = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 32})
        print("cached tokens on repeat:", again["meta_info"]["cached_tokens"])

        # A batch with n samples each, and a streamed completion.
        outs = engine.generate(
            [prompt, "Once upon a time"], {"temperature": 0.8, "max_new_tokens": 16, "n": 2, "seed": 1}
        )
        for o in outs:
            print("sample:", repr(o["text"]))
        print("stream: ", end="", flush=True)
        shown = ""
        for chunk in engine.generate(
            "The three primary colors are", {"temperature": 0, "max_new_tokens": 24}, stream=True
        ):
            print(chunk["text"][len(shown) :], end="", flush=True)
            shown = chunk["text"]
        print()


if __name__ == "__main__":
    main()
