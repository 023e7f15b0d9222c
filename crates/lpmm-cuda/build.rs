//! With the `emulate` feature: compiles the CUDA kernels as C++ for the host (kernels/emulate.cpp
//! includes the generated kernels/lpmm.generated.cu with host definitions of CUDA's built-ins).

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    #[cfg(feature = "emulate")]
    {
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file("kernels/emulate.cpp")
            // The CPU reference never contracts a * b + c; neither may the host build.
            .flag("-ffp-contract=off")
            .flag_if_supported("-fno-fast-math")
            // Rule constants are read through a struct over the descriptor's words.
            .flag("-fno-strict-aliasing")
            // `#pragma unroll` is for NVRTC.
            .flag("-Wno-unknown-pragmas")
            .warnings(true)
            .compile("lpmm_cuda_emulate");
    }
}
