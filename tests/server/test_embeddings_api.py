"""/v1/embeddings and /tokenize-style inputs through the clients users have, on the default model:
the openai SDK (which asks for base64 by default), langchain-openai's OpenAIEmbeddings, and raw
requests for token-id input and the errors."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_openai_sdk_embeddings_equal_engine_encode(client, engine):
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by four percent."]
    r = client.embeddings.create(model="smollm2", input=texts)  # base64 on the wire
    assert [d.index for d in r.data] == [0, 1] and r.model == "smollm2"
    direct = engine.encode(texts)
    for d, e in zip(r.data, direct):
        assert len(d.embedding) == engine.hidden_size
        assert abs(math.sqrt(sum(x * x for x in d.embedding)) - 1) < 1e-4
        assert _close(d.embedding, e["embedding"])
    assert r.usage.prompt_tokens == sum(e["meta_info"]["prompt_tokens"] for e in direct)
    floats = client.embeddings.create(model="smollm2", input=texts[0], encoding_format="float")
    assert _close(floats.data[0].embedding, r.data[0].embedding)


def test_langchain_openai_embeddings(url, engine):
    lc = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length would tokenize with tiktoken (a download); plain strings go as they are
    emb = lc.OpenAIEmbeddings(model="smollm2", base_url=url + "/v1", api_key="unused", check_embedding_ctx_length=False)
    docs = emb.embed_documents(["first document", "second document"])
    query = emb.embed_query("first document")
    assert len(docs) == 2 and _close(query, docs[0]) and len(query) == engine.hidden_size


def test_token_ids_and_errors(url, engine):
    ids = engine.tokenizer("The cat sat on the mat.").input_ids
    with httpx.Client(base_url=url, timeout=60) as http:
        by_ids = http.post("/v1/embeddings", json={"input": ids, "encoding_format": "float"}).json()
        by_text = http.post(
            "/v1/embeddings", json={"input": "The cat sat on the mat.", "encoding_format": "float"}
        ).json()
        assert _close(by_ids["data"][0]["embedding"], by_text["data"][0]["embedding"])
        for body, word in (
            ({"input": []}, "input"),
            ({"input": [""]}, "empty"),
            ({"input": "x", "dimensions": 8}, "dimensions"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ({"input": "x", "model": "other"}, "does not exist"),
        ):
            r = http.post("/v1/embeddings", json=body)
            assert r.status_code in (400, 404) and word in r.json()["error"]["message"], (body, r.text)
