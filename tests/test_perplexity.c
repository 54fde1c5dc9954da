/*
 * Perplexity of the small trained qwen3next model (../shared/fixtures/
 * small-model) on its held-out text, with llama-perplexity's method
 * (-c 512, 39 chunks): must be within 1% of llama.cpp's 50.96 on the same
 * file. A real trained model's routing and DeltaNet state make this a check
 * of the whole engine on Q8_0 weights.
 */
#include <math.h>

#include "common/log.h"
#include "coordinator/perplexity.h"
#include "tests/check.h"

#define PPL_LLAMA_CPP 50.96 /* llama-perplexity -c 512 on eval.txt (fixture README) */
#define PPL_TOL 0.01        /* relative */

int main(void)
{
    log_init("test", -1);
    char model[512], text[512];
    struct perplexity_config pc = {
        .model_path = test_fixture(model, sizeof(model), "small-model/qwen3next-small-q8_0.gguf"),
        .text_path = test_fixture(text, sizeof(text), "small-model/eval.txt"),
        .n_ctx = 512,
        .n_threads = 2,
    };
    struct perplexity_result r;
    int rc = perplexity_run(&pc, &r);
    CHECK(rc == 0, "perplexity_run failed: %d", rc);
    if (rc == 0) {
        double rel = fabs(r.ppl - PPL_LLAMA_CPP) / PPL_LLAMA_CPP;
        MEASURE("small-model PPL %.4f +/- %.4f over %u chunks (%llu tokens, %.1f s); llama.cpp "
                "%.2f; relative difference %.4f (bound %.2f)",
                r.ppl, r.ppl_err, r.n_chunks, (unsigned long long)r.n_scored, r.seconds,
                PPL_LLAMA_CPP, rel, PPL_TOL);
        CHECK(r.n_chunks == 39, "expected 39 chunks, got %u", r.n_chunks);
        CHECK(rel <= PPL_TOL, "PPL %.4f differs from llama.cpp's %.2f by %.2f%%", r.ppl,
              PPL_LLAMA_CPP, rel * 100);
    }
    pc.n_ctx = 1 << 20;
    CHECK(perplexity_run(&pc, &r) != 0, "a text shorter than two chunks must be rejected");
    return test_main_result("test_perplexity");
}
