"""A reference tokenizer for SmolLM2, independent of the Rust code.

Builds a HuggingFace `tokenizers` BPE tokenizer from the vocabulary and merges
stored in the GGUF file, with SmolLM2's pre-tokenizer (individual digits, then
GPT-2 byte-level splitting). Control and user-defined tokens are registered as special tokens, so
they are recognised as single tokens in text (as in a rendered chat template).
"""

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3
USER_DEFINED = 4


def gguf_vocab(path):
    reader = GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    return field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges"), field("tokenizer.ggml.token_type")


def build_tokenizer(path, specials=True):
    tokens, merges, types = gguf_vocab(path)
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    if specials:
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
        )
    return tok
