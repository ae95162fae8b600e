/* fp16 bits (IEEE binary16) to float, for the finite values a KV cache holds (no inf or NaN).
 * Plain integer and float arithmetic, so loops over it vectorize on CPUs without native fp16
 * arithmetic, where a _Float16 conversion becomes a library call per element. */
#include <stdint.h>

static inline float half_to_float(uint16_t h)
{
    /* Shifted into a float's bit layout the half is 2^-112 of its value, normal or subnormal. */
    union { uint32_t bits; float value; } magnitude = { (uint32_t)(h & 0x7fff) << 13 }, out;
    out.value = magnitude.value * 0x1p112f;
    out.bits |= (uint32_t)(h & 0x8000) << 16;
    return out.value;
}
