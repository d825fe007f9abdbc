// Shared helpers, prepended to every kernel source. No CUDA toolkit header is included:
// f16 conversions go through PTX (cvt.rn.f16.f32 rounds to nearest even, like `half`).
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
struct alignas(16) vec4u { u32 x, y, z, w; };
struct alignas(8) vec2u { u32 x, y; };
#define FULL_MASK 0xffffffffu
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// {lo, hi} -> f16x2 with lo in the low half.
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
// D (16×8, f32) += A (16×16 f16, row-major fragments) · B (16×8 f16, column fragments): the
// m16n8k16 tensor-core product (sm_80 and newer), used by decode.cu and prefill.cu.
__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
// √(π/2)/d: the sketch estimator's scale (sketch.rs `scale`, rounded from f64 the same way).
#define SKETCH_C(dim) ((float)(1.2533141373155001 / (dim)))
// Floats of a dense rotation's matrices after a format's own transform words per head
// (head sizes that are not a power of two: format.rs `GpuFormat::dense`): DENSE_W for the
// encode and cache modules' format, KDENSE_W / VDENSE_W for decode's keys and values; 0 for
// a Hadamard rotation (whose signs and scale the kernels apply), or none.
#ifndef DENSE_W
#define DENSE_W 0
#endif
#ifndef KDENSE_W
#define KDENSE_W 0
#endif
#ifndef VDENSE_W
#define VDENSE_W 0
#endif

// Code i (NB bits at bit i·NB) of a packed segment at any byte alignment: d = 80 and 112,
// whose rows need not start on a word boundary. NB ≤ 4: within two bytes.
template <int NB>
__device__ __forceinline__ u32 code_at_bytes(const u8* seg, int i) {
    const int bit = i * NB, by = bit >> 3, o = bit & 7;
    u32 x = seg[by];
    if (o + NB > 8) x |= (u32)seg[by + 1] << 8;
    return (x >> o) & ((1u << NB) - 1u);
}
