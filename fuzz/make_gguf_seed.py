"""Write a tiny valid GGUF (v3): llama metadata and a 6-token byte-level BPE tokenizer, no
tensors. The seed for the gguf_metadata fuzz target: `python3 fuzz/make_gguf_seed.py OUT`."""
import struct, sys

def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b

U32, I32, F32, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9

def kv(key, vtype, payload):
    return s(key) + struct.pack("<I", vtype) + payload

def arr(etype, items, enc):
    return struct.pack("<IQ", etype, len(items)) + b"".join(enc(i) for i in items)

tokens = ["H", "e", "l", "o", "He", "ll"]
meta = [
    kv("general.architecture", STR, s("llama")),
    kv("llama.block_count", U32, struct.pack("<I", 2)),
    kv("llama.context_length", U32, struct.pack("<I", 256)),
    kv("llama.embedding_length", U32, struct.pack("<I", 64)),
    kv("llama.feed_forward_length", U32, struct.pack("<I", 128)),
    kv("llama.attention.head_count", U32, struct.pack("<I", 4)),
    kv("llama.attention.head_count_kv", U32, struct.pack("<I", 2)),
    kv("llama.rope.freq_base", F32, struct.pack("<f", 10000.0)),
    kv("llama.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", 1e-5)),
    kv("tokenizer.ggml.model", STR, s("gpt2")),
    kv("tokenizer.ggml.pre", STR, s("smollm")),
    kv("tokenizer.ggml.tokens", ARR, arr(STR, tokens, s)),
    kv("tokenizer.ggml.token_type", ARR, arr(I32, [1] * len(tokens), lambda v: struct.pack("<i", v))),
    kv("tokenizer.ggml.merges", ARR, arr(STR, ["H e", "l l"], s)),
    kv("tokenizer.ggml.eos_token_id", U32, struct.pack("<I", 3)),
    kv("tokenizer.ggml.add_bos_token", BOOL, b"\x00"),
]
out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta)) + b"".join(meta)
open(sys.argv[1], "wb").write(out)
print(f"{sys.argv[1]}: {len(out)} B")
