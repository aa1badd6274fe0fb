"""Chat templates for role blocks: each role's prefix and suffix as text.

`from_tokenizer` derives them from a model's own (Jinja) chat template by rendering probe
conversations with marker contents and cutting the text around the markers; named templates
("default", "chatml", "llama-3") are the fallbacks and can be chosen explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")


@dataclass
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: list[str] = field(default_factory=list)

    def get_prefix_and_suffix(self, role: str, first_message: bool = False) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if first_message and role == "user" and self.default_system_prompt is not None:
            sp, ss = self.role_prefix_and_suffix["system"]
            prefix = sp + self.default_system_prompt + ss + prefix
        return prefix, suffix


NAMED: dict[str, ChatTemplate] = {
    "default": ChatTemplate(
        "default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")}
    ),
    "chatml": ChatTemplate(
        "chatml", {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}, stop_str=["<|im_end|>"]
    ),
    "llama-3": ChatTemplate(
        "llama-3",
        {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES},
        stop_str=["<|eot_id|>"],
    ),
}
NAMED["llama3"] = NAMED["llama-3"]


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return NAMED[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(NAMED)}") from None


def guess_by_name(model_path: str) -> ChatTemplate:
    """Pick a named template from a model name (when no tokenizer is at hand)."""
    p = model_path.lower()
    if any(k in p for k in ("smollm", "qwen", "chatml", "hermes", "yi-")):
        return NAMED["chatml"]
    if "llama-3" in p or "llama3" in p:
        return NAMED["llama-3"]
    return NAMED["default"]


_S, _U, _A = "\x00SYS\x00", "\x00USR\x00", "\x00AST\x00"


def from_tokenizer(tokenizer, name: str = "model") -> ChatTemplate | None:
    """Derive role prefixes/suffixes from the tokenizer's chat template; None if it has none or
    its rendering cannot be cut into per-role blocks."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(msgs, gen=False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    try:
        sys_ok = True
        try:
            r1 = render([{"role": "system", "content": _S}])
        except Exception:  # templates that refuse a system role
            sys_ok, r1 = False, ""
        base = [{"role": "system", "content": _S}] if sys_ok else []
        r2 = render(base + [{"role": "user", "content": _U}])
        r3 = render(base + [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}])
        if not (r2.startswith(r1) and r3.startswith(r2)):
            return None
        table: dict[str, tuple[str, str]] = {}
        if sys_ok:
            i = r1.index(_S)
            table["system"] = (r1[:i], r1[i + len(_S) :])
        i = r2.index(_U, len(r1))
        table["user"] = (r2[len(r1) : i], r2[i + len(_U) :])
        i = r3.index(_A, len(r2))
        table["assistant"] = (r3[len(r2) : i], r3[i + len(_A) :])
        # the text before the first block is the BOS the tokenizer adds itself: drop it
        bos = getattr(tokenizer, "bos_token", None)
        first = "system" if sys_ok else "user"
        if bos and table[first][0].startswith(bos):
            ids = tokenizer("x").input_ids
            if ids and ids[0] == tokenizer.bos_token_id:
                for role, (p, s) in table.items():
                    if p.startswith(bos):
                        table[role] = (p[len(bos) :], s)
        if not sys_ok:
            table["system"] = table["user"]
        default_system = None
        if sys_ok:  # a template that inserts its own system block when a conversation has none
            r_user = render([{"role": "user", "content": _U}])
            head = r_user[: r_user.index(_U)]
            sp, ss = table["system"]
            up = table["user"][0]
            if bos and head.startswith(bos) and not sp.startswith(bos):
                head = head[len(bos) :]
            if head != up and head.startswith(sp) and head.endswith(ss + up):
                default_system = head[len(sp) : len(head) - len(ss + up)]
        stop = [s.strip() for s in (table["assistant"][1],) if s.strip()]
        return ChatTemplate(name, table, default_system_prompt=default_system, stop_str=stop)
    except Exception:
        return None
