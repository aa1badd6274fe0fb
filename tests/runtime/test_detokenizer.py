"""The detokenizer process's logic without processes: per-request incremental detokenization of
a stream of TokenOutputs (multibyte characters split across tokens, interleaved requests), a final
EOS / stop-token id left out of the text, options from a request's first output, and state dropped
when a request finishes."""

from __future__ import annotations

import pytest

from plait.runtime.managers.detokenizer_process import DetokenizerWorker
from plait.runtime.managers.ipc import Codec, Ready, RpcReply, ToDetokenizer, TokenOutputBatch
from plait.runtime.request import TokenOutput


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from plait.runtime.model_executor.model_loader import load_tokenizer

    return load_tokenizer(smollm2_path)


def _split_char_ids(tok, text: str) -> list[int]:
    ids = tok(text, add_special_tokens=False).input_ids
    # the test is only meaningful if some token alone decodes to an incomplete character
    assert any("\ufffd" in tok.decode([i]) for i in ids), "expected a character split across tokens"
    return ids


def test_interleaved_multibyte_streams_and_eos(tokenizer):
    eos = tokenizer.eos_token_id
    texts = {"a": "Grüße aus Köln 🙂🎉 ok", "b": "日本語のテキスト and 😀 done"}
    ids = {rid: _split_char_ids(tokenizer, t) for rid, t in texts.items()}
    worker = DetokenizerWorker(tokenizer)
    codec = Codec(ToDetokenizer)
    deltas: dict[str, list[str]] = {"a": [], "b": []}
    steps = max(len(v) for v in ids.values())
    for i in range(steps + 1):
        outs = []
        for rid in ("a", "b"):
            seq = ids[rid]
            if i < len(seq):
                out = TokenOutput(rid=rid, new_ids=[seq[i]])
            elif i == len(seq):  # finish: the EOS id is counted but not shown
                out = TokenOutput(rid=rid, new_ids=[eos], finish_reason={"type": "stop", "matched": eos})
            else:
                continue
            if i == 0:
                out.skip_special_tokens, out.spaces_between_special_tokens = True, True
            outs.append(out)
        # through the wire format both ways, as in the process
        msg = codec.decode(codec.encode(worker.handle(codec.decode(codec.encode(TokenOutputBatch(outputs=outs))))))
        for out in msg.outputs:
            assert "\ufffd" not in out.text_delta  # never half a character
            assert out.skip_special_tokens is None  # not passed on
            deltas[out.rid].append(out.text_delta)
    for rid, text in texts.items():
        assert "".join(deltas[rid]) == tokenizer.decode(ids[rid], skip_special_tokens=True) == text
        assert any(d == "" for d in deltas[rid])  # some character was held until complete
    assert worker.states == {}  # dropped once finished


def test_options_from_first_output_and_matched_stop_token(tokenizer):
    eos = tokenizer.eos_token_id
    worker = DetokenizerWorker(tokenizer)
    hello = tokenizer("hello", add_special_tokens=False).input_ids
    # skip_special_tokens=False: a special token in the middle is shown; the final matched one is not
    first = TokenOutput(rid="r", new_ids=hello + [eos], skip_special_tokens=False)
    worker.handle(TokenOutputBatch(outputs=[first]))
    assert first.text_delta == "hello" + tokenizer.decode([eos])
    last = TokenOutput(rid="r", new_ids=hello + [eos], finish_reason={"type": "stop", "matched": eos})
    worker.handle(TokenOutputBatch(outputs=[last]))
    assert last.text_delta == "hello"
    # defaults when absent: special tokens skipped; a finish without a matched id keeps every token
    out = TokenOutput(rid="s", new_ids=hello + [eos] + hello, finish_reason={"type": "length"})
    worker.handle(TokenOutputBatch(outputs=[out]))
    assert out.text_delta == "hellohello"
    # a matched stop *string* (not an int) removes nothing; an abort with no ids gives ""
    out = TokenOutput(rid="t", new_ids=hello, finish_reason={"type": "stop", "matched": "lo"})
    worker.handle(TokenOutputBatch(outputs=[out]))
    assert out.text_delta == "hello"
    out = TokenOutput(rid="u", new_ids=[], finish_reason={"type": "abort", "message": "x"})
    worker.handle(TokenOutputBatch(outputs=[out]))
    assert out.text_delta == ""
    assert worker.states == {}
    # other messages pass unchanged
    for msg in (Ready(info={"a": 1}), RpcReply(id=3, result=True)):
        assert worker.handle(msg) is msg
