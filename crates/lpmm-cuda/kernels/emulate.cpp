// The CUDA kernels (lpmm.generated.cu) compiled for the host CPU, for tests on machines without a
// GPU.
//
// CUDA's built-ins get host definitions. A block's 256 threads are 256 fibers (ucontext) on the
// calling OS thread, run round-robin: each runs until it reaches `__syncthreads` (it yields to the
// scheduler) or returns, and the next round resumes them all, so no thread passes a barrier before
// every thread has reached it. `__shared__` variables are thread-local statics (one block runs at
// a time on a calling thread; concurrent launches from other threads have their own). Float
// arithmetic is IEEE single precision with no contraction (built with -ffp-contract=off;
// `__fmaf_rn` is the C library's correctly rounded fma). Atomics are `std::atomic_ref` on the
// words, which Rust holds as `AtomicU32`. The backend drives this exactly as it drives the GPU:
// same descriptors, same launches, pointers that are host addresses.

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <ucontext.h>
#include <vector>

#define LPMM_HOST 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

namespace {

struct Dim3 {
    uint32_t x, y, z;
};

thread_local Dim3 threadIdx;
thread_local Dim3 blockIdx;
thread_local Dim3 gridDim;

// CUDA's vector types, as aligned as CUDA's.
struct alignas(16) uint4 {
    uint32_t x, y, z, w;
};

struct alignas(8) uint2 {
    uint32_t x, y;
};

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done;
};

// The calling thread's fibers and scheduler context.
thread_local std::vector<Fiber> fibers;
thread_local ucontext_t scheduler;
thread_local uint32_t current;

inline void __syncthreads() { swapcontext(&fibers[current].ctx, &scheduler); }

// A warp's barrier: the block's (every thread of a block reaches the same ones).
inline void __syncwarp() { __syncthreads(); }

// Threads per block (THREADS of the generated header, checked below).
constexpr uint32_t EMULATED_THREADS = 256;

// The warp shuffle: each thread publishes its value, passes a barrier, and reads its partner's
// (lane ^ mask within its warp of 32). Two buffers, used in turn: a thread writes one only after
// the barrier that follows every thread's read of the value it held before (shuffles are called
// by every thread of a block alike, as the specialized steps call them).
thread_local uint32_t shuffled[2][EMULATED_THREADS];
thread_local uint32_t shuffles[EMULATED_THREADS];

inline uint32_t __shfl_xor_sync(uint32_t /*mask*/, uint32_t v, uint32_t lane_mask) {
    uint32_t lt = threadIdx.x;
    uint32_t b = shuffles[lt]++ & 1u;
    shuffled[b][lt] = v;
    __syncthreads();
    return shuffled[b][(lt & ~31u) | ((lt & 31u) ^ lane_mask)];
}

inline uint32_t __float_as_uint(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
}

inline float __uint_as_float(uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }

inline uint32_t atomicOr(uint32_t* p, uint32_t v) {
    return std::atomic_ref<uint32_t>(*p).fetch_or(v, std::memory_order_relaxed);
}

inline uint32_t atomicAdd(uint32_t* p, uint32_t v) {
    return std::atomic_ref<uint32_t>(*p).fetch_add(v, std::memory_order_relaxed);
}

inline uint32_t atomicMax(uint32_t* p, uint32_t v) {
    std::atomic_ref<uint32_t> a(*p);
    uint32_t old = a.load(std::memory_order_relaxed);
    while (old < v && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
    }
    return old;
}

// The specialized steps' test hook (plan_lanes.cuh PLAN_FORCE_COLD): every cold path taken.
thread_local bool lpmm_force_cold = false;

// CUDA-only pragmas and the arguments some formats do not use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "lpmm.generated.cu"
#pragma GCC diagnostic pop

static_assert(THREADS == EMULATED_THREADS, "the shuffles' buffers hold a block");

using Kernel = void (*)(const Desc*, uint32_t, const uint32_t*, uint32_t*);

// In abi.rs `Entry` order (ENTRY_* of the generated header).
const Kernel KERNELS[] = {lpmm_init, lpmm_accumulate, lpmm_decode, lpmm_clear,
                          lpmm_step, lpmm_fold,       lpmm_check};
static_assert(sizeof(KERNELS) / sizeof(KERNELS[0]) == ENTRY_CHECK + 1, "one kernel per entry");

struct Launch {
    Kernel f;
    const Desc* descs;
    uint32_t ndesc;
    const uint32_t* maps;
    uint32_t* flags;
};

thread_local Launch launch;

void fiber_main() {
    launch.f(launch.descs, launch.ndesc, launch.maps, launch.flags);
    fibers[current].done = true;
    // Returning resumes `scheduler` (uc_link).
}

constexpr size_t STACK = 64 * 1024;

// Runs `f` over `grid` blocks of THREADS threads. Returns 0, or -2 if a fiber could not be set
// up.
int run(Kernel f, uint32_t grid, const Desc* descs, uint32_t ndesc, const uint32_t* maps,
        uint32_t* flags) {
    launch = Launch{f, descs, ndesc, maps, flags};
    if (fibers.size() != THREADS) {
        fibers.resize(THREADS);
        for (auto& f : fibers) {
            f.stack.resize(STACK);
        }
    }
    gridDim = Dim3{grid, 1, 1};
    for (uint32_t b = 0; b < grid; b++) {
        blockIdx = Dim3{b, 0, 0};
        for (uint32_t lt = 0; lt < THREADS; lt++) {
            Fiber& f = fibers[lt];
            if (getcontext(&f.ctx) != 0) {
                return -2;
            }
            f.ctx.uc_stack.ss_sp = f.stack.data();
            f.ctx.uc_stack.ss_size = f.stack.size();
            f.ctx.uc_link = &scheduler;
            f.done = false;
            makecontext(&f.ctx, fiber_main, 0);
        }
        bool running = true;
        while (running) {
            running = false;
            for (uint32_t lt = 0; lt < THREADS; lt++) {
                if (!fibers[lt].done) {
                    current = lt;
                    threadIdx = Dim3{lt, 0, 0};
                    swapcontext(&scheduler, &fibers[lt].ctx);
                    running = running || !fibers[lt].done;
                }
            }
        }
    }
    return 0;
}

} // namespace

// Runs entry `kernel` (abi.rs `Entry` as a number) over `grid` blocks of THREADS threads.
// Returns 0, -1 for an unknown entry, -2 if a fiber could not be set up.
extern "C" int lpmm_emulate(uint32_t kernel, uint32_t grid, const Desc* descs, uint32_t ndesc,
                            const uint32_t* maps, uint32_t* flags) {
    if (kernel >= sizeof(KERNELS) / sizeof(KERNELS[0])) {
        return -1;
    }
    return run(KERNELS[kernel], grid, descs, ndesc, maps, flags);
}

// Runs specialized step `plan` (lpmm-backend plans.rs, the generated LPMM_PLAN_KERNELS) as
// `lpmm_emulate` runs an entry. Returns 0, -1 for an unknown plan, -2 as above.
extern "C" int lpmm_emulate_plan(uint32_t plan, uint32_t grid, const Desc* descs, uint32_t ndesc,
                                 const uint32_t* maps, uint32_t* flags) {
    if (plan >= sizeof(LPMM_PLAN_KERNELS) / sizeof(LPMM_PLAN_KERNELS[0])) {
        return -1;
    }
    return run(LPMM_PLAN_KERNELS[plan], grid, descs, ndesc, maps, flags);
}

// Makes the specialized steps launched from the calling thread take every cold path they have
// (`on` nonzero) or none they need not (0): a test hook.
extern "C" void lpmm_emulate_force_cold(int on) { lpmm_force_cold = on != 0; }

// The exact shortcuts (exact.cuh) as the kernels compute them, for tests/exact.rs.
extern "C" float lpmm_emulate_exact_quotient(float a, float b, float rb) {
    return exact_quotient(a, b, rb);
}

extern "C" uint32_t lpmm_emulate_exact_bf16(float x, uint32_t r, int stochastic) {
    return stochastic != 0 ? exact_bf16_stochastic(x, r) : exact_bf16_nearest(x);
}

extern "C" uint32_t lpmm_emulate_exact_bucket(float y, int linear) {
    return linear != 0 ? exact_linear_bucket(y) : exact_bucket(y);
}

// The codes the specialized steps give the quotients `ys` (with draws `rs` where `stochastic`)
// with map `map` of the table `maps` in shared map 0, its buckets `linear` or logarithmic: the
// map loaded and its bucket table built as a block's threads do (one after another), then
// plan_nearest or plan_stochastic, read back from a packed word. Writes `n` codes to `out`.
extern "C" void lpmm_emulate_codes(const uint32_t* maps, uint32_t map, int stochastic, int linear,
                                   const float* ys, const uint32_t* rs, uint32_t n,
                                   uint32_t* out) {
    for (uint32_t t = 0; t < THREADS; t++) {
        threadIdx = Dim3{t, 0, 0};
        plan_load_map(0u, maps, map, stochastic != 0);
    }
    for (uint32_t t = 0; t < THREADS; t++) {
        threadIdx = Dim3{t, 0, 0};
        plan_build_map(0u, linear != 0);
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t w = stochastic != 0 ? 0xFFFFFFFFu : 0u;
        if (stochastic != 0 && linear != 0) {
            plan_stochastic<true>(0u, ys[i], rs[i], w, 0u);
        } else if (stochastic != 0) {
            plan_stochastic<false>(0u, ys[i], rs[i], w, 0u);
        } else if (linear != 0) {
            plan_nearest<true>(0u, ys[i], w, 0u);
        } else {
            plan_nearest<false>(0u, ys[i], w, 0u);
        }
        out[i] = w;
    }
}

// The layout the Rust side mirrors: sizeof(Desc), offsetof(Desc, slots), sizeof(SlotDesc).
extern "C" void lpmm_emulate_layout(uint32_t out[3]) {
    out[0] = sizeof(Desc);
    out[1] = offsetof(Desc, slots);
    out[2] = sizeof(SlotDesc);
}
