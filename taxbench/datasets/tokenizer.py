"""The simple tokenizer used to build shards: one token per byte of the input (vocabulary 256).

Byte-level encoding needs no vocabulary file and can be applied to any chunk of a file independently, so the builder
streams arbitrarily large text files in fixed-size chunks.
"""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, tokens: np.ndarray) -> bytes:
        return np.asarray(tokens, dtype=np.uint8).tobytes()
