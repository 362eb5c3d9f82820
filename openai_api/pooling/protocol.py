"""Request bodies of `/v1/embeddings` (OpenAI's), `/v1/rerank` (Jina's and Cohere's, as vLLM
serves it) and `/score` (vLLM's).  Unknown fields are a 400 naming them, as elsewhere."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, StrictStr

from tandem_serve.openai_api.protocol import Strict

# A list of token ids, or a list of such lists (OpenAI's array forms of `input`).
TokenIds = list[StrictInt]


class PoolingCommon(Strict):
    model: str | None = None
    user: str | None = None
    # vLLM: keep the first N tokens of each input, special tokens included (-1: the model's
    # limit); None: an input over the limit is a 400.
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)


class EmbeddingRequest(PoolingCommon):
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None


class RerankDocument(Strict):
    text: StrictStr


class RerankRequest(PoolingCommon):
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: StrictInt | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True


class ScoreRequest(PoolingCommon):
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
