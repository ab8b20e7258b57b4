// Reference blocks from GGML itself for kiln-quantize's Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 quantizers.
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
//        (TYPE: q4_k q5_k q6_k q5_0 q5_1)

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
        size_t size;
        void * y;
        if (!strcmp(t, "q4_k") || !strcmp(t, "q5_k") || !strcmp(t, "q6_k")) {
            if (n % QK_K != 0) fail("input is not whole blocks of 256 floats for", t);
            size_t block = !strcmp(t, "q4_k") ? sizeof(block_q4_K)
                         : !strcmp(t, "q5_k") ? sizeof(block_q5_K) : sizeof(block_q6_K);
            size = (size_t) (n / QK_K) * block;
            y = calloc(1, size);
            if (imatrix) {
                if (!strcmp(t, "q4_k")) quantize_q4_K(x, y, nrow, n_per_row, imatrix);
                else if (!strcmp(t, "q5_k")) quantize_q5_K(x, y, nrow, n_per_row, imatrix);
                else quantize_q6_K(x, y, nrow, n_per_row, imatrix);
            } else if (!strcmp(t, "q4_k")) quantize_row_q4_K_ref(x, y, n);
            else if (!strcmp(t, "q5_k")) quantize_row_q5_K_ref(x, y, n);
            else quantize_row_q6_K_ref(x, y, n);
        } else if (!strcmp(t, "q5_0")) {
            size = (size_t) (n / QK5_0) * sizeof(block_q5_0);
            y = calloc(1, size);
            if (imatrix) quantize_q5_0(x, y, nrow, n_per_row, imatrix);
            else quantize_row_q5_0_ref(x, y, n);
        } else if (!strcmp(t, "q5_1")) {
            size = (size_t) (n / QK5_1) * sizeof(block_q5_1);
            y = calloc(1, size);
            if (imatrix) quantize_q5_1(x, y, nrow, n_per_row, imatrix);
            else quantize_row_q5_1_ref(x, y, n);
        } else {
            fail("unknown type", t);
            return 1;
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/%s%s.bin", argv[2], argv[3], t);
        FILE * o = fopen(path, "wb");
        if (!o || fwrite(y, 1, size, o) != size || fclose(o) != 0) fail("cannot write", path);
        printf("%s: %zu bytes\n", path, size);
        free(y);
    }
    free(x);
    return 0;
}
