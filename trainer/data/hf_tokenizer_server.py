"""Serves one Hugging Face tokenizer.json to the trainer (trainer/data/hf_tokenizer.cc) over stdin/stdout.

Usage: python hf_tokenizer_server.py TOKENIZER_JSON

Runs the maintained `tokenizers` package (as transformers does) so that ids match Hugging Face's
exactly. The protocol is binary, little-endian, one request answered at a time:

  request:  op (1 byte) | payload length (u64) | payload
  response: status (1 byte: b"O" ok, b"X" error) | payload length (u64) | payload

At start, before any request, the server sends one response: on success a JSON object
{"vocab_size": N, "added_tokens": [{"id", "content", "special"}...]}; on failure a JSON object
{"kind": "import" | "load", "message": ...}. Requests:

  b"E" encode a batch: u32 count, then per text u32 length and UTF-8 bytes. Answer: per text
       u32 count and that many u32 ids (special tokens are not added).
  b"D" decode: u32 ids. Answer: the UTF-8 text, special tokens skipped.

EOF on stdin ends the server.
"""

import json
import struct
import sys


def read_exact(stream, size):
    data = stream.read(size)
    if data is None or len(data) != size:
        return None
    return data


def send(out, status, payload):
    out.write(status + struct.pack("<Q", len(payload)) + payload)
    out.flush()


def encode_batch(tokenizer, payload):
    (count,) = struct.unpack_from("<I", payload, 0)
    offset = 4
    texts = []
    for _ in range(count):
        (size,) = struct.unpack_from("<I", payload, offset)
        offset += 4
        # Text that is not UTF-8 fails here, and the error reaches the caller.
        texts.append(payload[offset:offset + size].decode("utf-8"))
        offset += size
    parts = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids = encoding.ids
        parts.append(struct.pack("<I%dI" % len(ids), len(ids), *ids))
    return b"".join(parts)


def decode(tokenizer, payload):
    ids = list(struct.unpack("<%dI" % (len(payload) // 4), payload))
    return tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8")


def main():
    stdin = sys.stdin.buffer
    out = sys.stdout.buffer
    # Nothing else may write to the protocol stream.
    sys.stdout = sys.stderr
    if len(sys.argv) != 2:
        send(out, b"X", json.dumps({"kind": "load", "message": "usage: %s TOKENIZER_JSON" %
                                    sys.argv[0]}).encode())
        return 2
    try:
        import tokenizers
    except Exception as error:  # ImportError, or a broken install
        send(out, b"X", json.dumps({"kind": "import", "message": "%s: %s" % (
            sys.executable, error)}).encode())
        return 1
    try:
        tokenizer = tokenizers.Tokenizer.from_file(sys.argv[1])
    except Exception as error:
        send(out, b"X", json.dumps({"kind": "load", "message": str(error)}).encode())
        return 1
    added = [{"id": int(token_id), "content": token.content, "special": bool(token.special)}
             for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())]
    send(out, b"O", json.dumps({
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "added_tokens": added,
    }).encode())

    handlers = {b"E": encode_batch, b"D": decode}
    while True:
        header = read_exact(stdin, 9)
        if header is None:
            return 0
        op = header[:1]
        (size,) = struct.unpack("<Q", header[1:])
        payload = read_exact(stdin, size)
        if payload is None:
            return 0
        handler = handlers.get(op)
        if handler is None:
            send(out, b"X", ("unknown request %r" % op).encode())
            continue
        try:
            send(out, b"O", handler(tokenizer, payload))
        except Exception as error:
            send(out, b"X", ("%s: %s" % (type(error).__name__, error)).encode())


if __name__ == "__main__":
    sys.exit(main())
