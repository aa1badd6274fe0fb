"""How a model family writes tool calls (`--tool-call-parser`), and which format a chat template uses.

A format says where calls start in the generated text and how one call is spelled, which is all
three users of it need: auto mode's structural tag (each call the model opens is held to the
offered tools' schemas), the parser that reads calls back out of the text, and the stream that
holds back text that may be a call. The families, as SGLang and vLLM name them:

- hermes (Qwen2.5 / Qwen3, Hermes, our own tools block): `<tool_call>\\n{"name", "arguments"}\\n</tool_call>`
- llama3 (Llama 3.1-3.3 JSON tool calling): a bare `{"name", "parameters"}` answer, `;` between
  calls, sometimes after `<|python_tag|>`
- mistral: `[TOOL_CALLS][{"name", "arguments"}, ...]`
- json: a bare `{"name", "arguments"}` object (or a list of them), or Hermes blocks, read from free
  text with no grammar: the fallback for templates that render tools in a way we cannot tell
"""

from __future__ import annotations

import dataclasses
import json

PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker before a call (a special token, usually skipped)


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """One family's spelling of tool calls."""

    name: str
    open: str | None  # the text that starts calls (None: the call is a bare JSON value)
    close: str | None = None  # the text that ends each call (Hermes)
    args_key: str = "arguments"  # "parameters" for Llama 3
    array: bool = False  # the calls after `open` are one JSON array (Mistral)
    constrained: bool = True  # auto mode holds each call to the tools' schemas (a structural tag)

    @property
    def trigger(self) -> str:
        """The text that makes auto mode's grammar start a call."""
        return self.open if self.open is not None else '{"name": '

    def begin(self, name: str) -> str:
        """A call of `name` up to its arguments' JSON."""
        head = f"{self.open}\n" if self.close else (self.open or "")
        return f'{head}{"[" if self.array else ""}{{"name": {json.dumps(name)}, "{self.args_key}": '

    @property
    def end(self) -> str:
        """The text after a call's arguments."""
        return "}" + ("]" if self.array else "") + (f"\n{self.close}" if self.close else "")


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3 = ToolCallFormat("llama3", None, args_key="parameters")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", array=True)
PLAIN_JSON = ToolCallFormat("json", "<tool_call>", "</tool_call>", constrained=False)
FORMATS = {
    "hermes": HERMES,
    "qwen25": HERMES,
    "qwen": HERMES,
    "llama3": LLAMA3,
    "llama3_json": LLAMA3,
    "mistral": MISTRAL,
    "json": PLAIN_JSON,
}


def detect_format(template: str) -> ToolCallFormat:
    """The format a chat template's source asks of the model. A template that does not render
    tools gets our Hermes tools block, so its model is asked for Hermes calls."""
    if "tools" not in template or HERMES.open in template:
        return HERMES
    if MISTRAL.open in template:
        return MISTRAL
    if PYTHON_TAG in template or '"parameters"' in template:
        return LLAMA3
    return PLAIN_JSON


def tool_call_format(parser: str, template: str) -> ToolCallFormat:
    """The format of `--tool-call-parser` (auto: the template's; a template that does not render
    tools always gets Hermes calls, which our tools block asks for)."""
    if parser == "auto" or "tools" not in template:
        return detect_format(template)
    return FORMATS[parser]
