// The rotation's sign pattern (DESIGN.md "KV tiers", kernels/cpu/rotation.py): element i of
// a row is negated before the butterfly when this hash of i is odd. Included by codecs.cu
// (the encoders) and attention.cu (query rotation, context unrotation); _build.py inlines
// it into their source text (once), so the compile caches see the header's contents.

__device__ __forceinline__ bool neg_sign(unsigned int i) {
    unsigned int x = (0x9E3779B9u ^ i) + 0x9E3779B9u;
    x = (x ^ (x >> 16)) * 0x85EBCA6Bu;
    x = (x ^ (x >> 13)) * 0xC2B2AE35u;
    x ^= x >> 16;
    return x & 1u;
}
