// Reference blocks from GGML itself for kiln-quantize's Q4_K/Q5_K/Q6_K/Q5_0/Q5_1, Q2_K/Q3_K
// and IQ4_NL/IQ4_XS quantizers.
//
// Reads little-endian float32 values from INPUT and writes, for each TYPE given, the blocks of
// GGML's quantize_row_<type>_ref over the whole input to OUT_DIR/<prefix><type>.bin. Linked
// against the libggml-base built from llama.cpp's sources (see make_kquant_vectors.sh).
//
// With --imatrix FILE N_PER_ROW first, the input is rows of N_PER_ROW values and each type is
// quantized by GGML's quantize_<type>(…, imatrix) with FILE's N_PER_ROW float32 weights: what
// llama-quantize --imatrix does.
//
// usage: ggml_kquants [--imatrix FILE N_PER_ROW] INPUT OUT_DIR PREFIX TYPE...
//        (TYPE: q4_k q5_k q6_k q5_0 q5_1 q2_k q3_k iq4_nl iq4_xs; for the last four also
//        OUT_DIR/<prefix><type>.deq.f32, GGML's dequantization of the blocks)

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-common.h"
#include "ggml-quants.h"

static void fail(const char * what, const char * arg) {
    fprintf(stderr, "ggml_kquants: %s: %s\n", what, arg);
    exit(1);
}

static float * read_floats(const char * path, int64_t * n) {
    FILE * f = fopen(path, "rb");
    if (!f) fail("cannot open", path);
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (bytes <= 0 || bytes % (32 * 4) != 0) fail("not whole blocks of 32 floats", path);
    *n = bytes / 4;
    float * x = malloc((size_t) bytes);
    if (!x || fread(x, 4, (size_t) *n, f) != (size_t) *n) fail("cannot read", path);
    fclose(f);
    return x;
}

// Reference row quantizer, importance-weighted quantizer and dequantizer of one GGML type
// (the dequantizer only for the types whose decoding Kiln checks from these files).
typedef void (*ref_fn)(const float *, void *, int64_t);
typedef size_t (*weighted_fn)(const float *, void *, int64_t, int64_t, const float *);
typedef void (*deq_fn)(const void *, float *, int64_t);

struct kind {
    const char * name;
    int64_t weights;
    size_t bytes;
    ref_fn ref;
    weighted_fn weighted;
    deq_fn dequantize;
};

// quantize_iq4_nl/xs without an importance matrix is what llama-quantize runs for them.
static void iq4_nl_plain(const float * x, void * y, int64_t n) {
    quantize_iq4_nl(x, y, n / QK4_NL, QK4_NL, NULL);
}
static void iq4_xs_plain(const float * x, void * y, int64_t n) {
    quantize_iq4_xs(x, y, n / QK_K, QK_K, NULL);
}

static const struct kind KINDS[] = {
    {"q4_k", QK_K, sizeof(block_q4_K), (ref_fn) quantize_row_q4_K_ref, quantize_q4_K, NULL},
    {"q5_k", QK_K, sizeof(block_q5_K), (ref_fn) quantize_row_q5_K_ref, quantize_q5_K, NULL},
    {"q6_k", QK_K, sizeof(block_q6_K), (ref_fn) quantize_row_q6_K_ref, quantize_q6_K, NULL},
    {"q5_0", QK5_0, sizeof(block_q5_0), (ref_fn) quantize_row_q5_0_ref, quantize_q5_0, NULL},
    {"q5_1", QK5_1, sizeof(block_q5_1), (ref_fn) quantize_row_q5_1_ref, quantize_q5_1, NULL},
    {"q2_k", QK_K, sizeof(block_q2_K), (ref_fn) quantize_row_q2_K_ref, quantize_q2_K,
     (deq_fn) dequantize_row_q2_K},
    {"q3_k", QK_K, sizeof(block_q3_K), (ref_fn) quantize_row_q3_K_ref, quantize_q3_K,
     (deq_fn) dequantize_row_q3_K},
    {"iq4_nl", QK4_NL, sizeof(block_iq4_nl), iq4_nl_plain, quantize_iq4_nl,
     (deq_fn) dequantize_row_iq4_nl},
    {"iq4_xs", QK_K, sizeof(block_iq4_xs), iq4_xs_plain, quantize_iq4_xs,
     (deq_fn) dequantize_row_iq4_xs},
};

static const struct kind * find_kind(const char * name) {
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; ++i) {
        if (!strcmp(KINDS[i].name, name)) return &KINDS[i];
    }
    return NULL;
}

int main(int argc, char ** argv) {
    const float * imatrix = NULL;
    int64_t n_per_row = 0;
    if (argc > 3 && !strcmp(argv[1], "--imatrix")) {
        int64_t m;
        imatrix = read_floats(argv[2], &m);
        n_per_row = atoll(argv[3]);
        if (n_per_row != m) fail("imatrix length differs from N_PER_ROW", argv[2]);
        argv += 3;
        argc -= 3;
    }
    if (argc < 5) {
        fail("usage", "ggml_kquants [--imatrix FILE N_PER_ROW] INPUT OUT_DIR PREFIX TYPE...");
    }
    FILE * f = fopen(argv[1], "rb");
    if (!f) fail("cannot open", argv[1]);
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (bytes <= 0 || bytes % (32 * 4) != 0) fail("input is not whole blocks of 32 floats", argv[1]);
    int64_t n = bytes / 4;
    float * x = malloc((size_t) bytes);
    if (!x || fread(x, 4, (size_t) n, f) != (size_t) n) fail("cannot read", argv[1]);
    fclose(f);
    if (imatrix && (n_per_row <= 0 || n % n_per_row != 0)) fail("input is not whole rows", argv[1]);
    const int64_t nrow = imatrix ? n / n_per_row : 0;

    for (int a = 4; a < argc; ++a) {
        const char * t = argv[a];
        const struct kind * k = find_kind(t);
        if (!k) fail("unknown type", t);
        if (n % k->weights != 0) fail("input is not whole blocks for", t);
        const size_t size = (size_t) (n / k->weights) * k->bytes;
        void * y = calloc(1, size);
        if (!y) fail("out of memory for", t);
        if (imatrix) k->weighted(x, y, nrow, n_per_row, imatrix);
        else k->ref(x, y, n);
        char path[4096];
        snprintf(path, sizeof path, "%s/%s%s.bin", argv[2], argv[3], t);
        FILE * o = fopen(path, "wb");
        if (!o || fwrite(y, 1, size, o) != size || fclose(o) != 0) fail("cannot write", path);
        printf("%s: %zu bytes\n", path, size);
        if (k->dequantize) {
            // GGML's own decoding of its blocks, for the dequantizers' bit-for-bit check.
            float * d = malloc((size_t) n * sizeof(float));
            if (!d) fail("out of memory for", t);
            k->dequantize(y, d, n);
            snprintf(path, sizeof path, "%s/%s%s.deq.f32", argv[2], argv[3], t);
            o = fopen(path, "wb");
            if (!o || fwrite(d, 4, (size_t) n, o) != (size_t) n || fclose(o) != 0) {
                fail("cannot write", path);
            }
            free(d);
        }
        free(y);
    }
    free(x);
    return 0;
}
