// llama.cpp's own answer for a model file: token ids, top logits at every
// prompt position, and a greedy continuation. The conformance fixtures in
// kernels/tests/fixtures/llamacpp_*.json are written from its output by
// scripts/llama_fixtures.py; it is built against the pinned llama.cpp by
// scripts/llama_cpp.sh. Nothing here shares code with Bulkhead's engine.
//
//   llama-reference MODEL GREEDY_COUNT < prompts
//   llama-reference VOCAB --tokenize < texts
//
// stdin: one prompt per line, its UTF-8 bytes in hex (so any text survives).
// stdout: one JSON object per prompt:
//   {"ids":[...], "top":[[[id,logit]x TOP] per position],
//    "greedy":[ids x GREEDY_COUNT], "margins":[top1-top2 before each]}
// Tokenized as llama.cpp does for a completion: special tokens added as the
// file says (BOS), special-token text not parsed. One thread, f32 KV cache,
// so the reference is as exact as llama.cpp gets.
//
// --tokenize loads the vocabulary only (a vocabulary-only GGUF will do) and
// prints {"ids":[...]} per text, tokenized as test-tokenizer-0 does: no BOS,
// special-token text not parsed.

#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

static const int TOP = 10;

static std::string from_hex(const std::string & hex) {
    std::string out;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
        out.push_back((char) std::stoi(hex.substr(i, 2), nullptr, 16));
    }
    return out;
}

// `text` as llama.cpp tokenizes it, special-token text not parsed; BOS and
// the like as the file says when `add_special`. Exits on failure.
static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text,
                                         bool add_special) {
    std::vector<llama_token> ids(text.size() + 8);
    int n = llama_tokenize(vocab, text.c_str(), (int) text.size(), ids.data(), (int) ids.size(),
                           add_special, false);
    if (n < 0) {
        fprintf(stderr, "tokenize failed\n");
        exit(1);
    }
    ids.resize(n);
    return ids;
}

static std::vector<std::pair<int, float>> top(const float * logits, int vocab, int count) {
    std::vector<int> ids(vocab);
    for (int i = 0; i < vocab; i++) ids[i] = i;
    std::partial_sort(ids.begin(), ids.begin() + count, ids.end(),
                      [&](int a, int b) { return logits[a] > logits[b]; });
    std::vector<std::pair<int, float>> out;
    for (int i = 0; i < count; i++) out.push_back({ids[i], logits[ids[i]]});
    return out;
}

static void print_top(const std::vector<std::pair<int, float>> & best) {
    printf("[");
    for (size_t i = 0; i < best.size(); i++) {
        printf("%s[%d,%.6f]", i ? "," : "", best[i].first, best[i].second);
    }
    printf("]");
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL GREEDY_COUNT < prompts\n", argv[0]);
        return 2;
    }
    const bool tokenize_only = std::string(argv[2]) == "--tokenize";
    const int greedy_count = tokenize_only ? 0 : atoi(argv[2]);
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.vocab_only = tokenize_only;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    if (tokenize_only) {
        std::string line;
        while (std::getline(std::cin, line)) {
            const std::vector<llama_token> ids = tokenize(vocab, from_hex(line), false);
            printf("{\"ids\":[");
            for (size_t i = 0; i < ids.size(); i++) printf("%s%d", i ? "," : "", ids[i]);
            printf("]}\n");
        }
        llama_model_free(model);
        return 0;
    }

    std::string line;
    while (std::getline(std::cin, line)) {
        const std::vector<llama_token> ids = tokenize(vocab, from_hex(line), true);
        const int n = (int) ids.size();

        llama_context_params cparams = llama_context_default_params();
        cparams.n_ctx = (uint32_t) (n + greedy_count + 16);
        cparams.n_batch = cparams.n_ctx;
        cparams.n_ubatch = cparams.n_ctx;
        cparams.n_threads = 1;
        cparams.n_threads_batch = 1;
        cparams.type_k = GGML_TYPE_F32;
        cparams.type_v = GGML_TYPE_F32;
        cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        llama_context * ctx = llama_init_from_model(model, cparams);
        if (!ctx) {
            fprintf(stderr, "cannot create a context\n");
            return 1;
        }

        // Every prompt position's logits: one batch with outputs everywhere.
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            batch.token[i] = ids[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = n;
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "decode failed\n");
            return 1;
        }
        printf("{\"ids\":[");
        for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", ids[i]);
        printf("],\"top\":[");
        for (int i = 0; i < n; i++) {
            printf("%s", i ? "," : "");
            print_top(top(llama_get_logits_ith(ctx, i), n_vocab, TOP));
        }
        printf("],\"greedy\":[");
        std::vector<float> margins;
        const float * last = llama_get_logits_ith(ctx, n - 1);
        for (int g = 0; g < greedy_count; g++) {
            auto best = top(last, n_vocab, 2);
            margins.push_back(best[0].second - best[1].second);
            llama_token next = best[0].first;
            printf("%s%d", g ? "," : "", next);
            llama_batch one = llama_batch_get_one(&next, 1);
            if (llama_decode(ctx, one) != 0) {
                fprintf(stderr, "decode failed\n");
                return 1;
            }
            last = llama_get_logits_ith(ctx, -1);
        }
        printf("],\"margins\":[");
        for (size_t i = 0; i < margins.size(); i++) printf("%s%.6f", i ? "," : "", margins[i]);
        printf("]}\n");
        fflush(stdout);
        llama_batch_free(batch);
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}
