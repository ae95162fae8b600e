/* fp16 bits (IEEE binary16) to and from float, for the finite values a KV cache holds (no inf or NaN).
 * Plain integer and float arithmetic, so loops over it vectorize on CPUs without native fp16
 * arithmetic, where a _Float16 conversion becomes a library call per element. */
#ifndef CABIN_HALF_H
#define CABIN_HALF_H
#include <stdint.h>

static inline float half_to_float(uint16_t h)
{
    /* Shifted into a float's bit layout the half is 2^-112 of its value, normal or subnormal. */
    union { uint32_t bits; float value; } magnitude = { (uint32_t)(h & 0x7fff) << 13 }, out;
    out.value = magnitude.value * 0x1p112f;
    out.bits |= (uint32_t)(h & 0x8000) << 16;
    return out.value;
}

/* float to fp16 bits, rounded to nearest even as torch's .half() rounds; overflow gives inf. */
static inline uint16_t float_to_half(float f)
{
    union { float value; uint32_t bits; } in = { f }, subnormal_magic = { .bits = 126u << 23 };  /* 0.5f */
    const uint32_t sign = in.bits & 0x80000000u;
    in.bits ^= sign;
    uint32_t out;
    if (in.bits >= 143u << 23)  /* 65536 and above, inf, NaN */
        out = in.bits > 255u << 23 ? 0x7e00 : 0x7c00;
    else if (in.bits < 113u << 23) {  /* below fp16's smallest normal: the float adder rounds the subnormal */
        in.value += subnormal_magic.value;
        out = in.bits - subnormal_magic.bits;
    } else {
        const uint32_t odd = (in.bits >> 13) & 1;
        in.bits += ((uint32_t)(15 - 127) << 23) + 0xfff + odd;
        out = in.bits >> 13;
    }
    return (uint16_t)(out | sign >> 16);
}
#endif
