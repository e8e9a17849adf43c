"""A flashfix patch pack with one backport (vLLM PR #51866)."""

from flashfix.semantic import Backport

PATCHES = (Backport(
    id="vllm-cpu-mixed-seed-sampling", engine="vllm", versions=">=0.23,<0.29",
    module="vllm.v1.sample.ops.topk_topp_sampler", function="TopKTopPSampler.forward_cpu",
    before="len($G) != $LOGITS.shape[0] and not self.use_fp64_gumbel",
    after="not $G and not self.use_fp64_gumbel",
    upstream="https://github.com/vllm-project/vllm/pull/51866", fixed_in="0.29.0",
    summary="CPU sampling honours per-request seeds when only part of the batch is seeded",
    doc="""Why: on CPU, a batch where some requests have a seed and others do not takes the
    fast path, which draws from the global generator: the seeded requests are not reproducible.
    How: the fast path is taken only when no request of the batch has a generator.

    Delete when: the pack no longer supports vLLM older than 0.29.0."""),)
