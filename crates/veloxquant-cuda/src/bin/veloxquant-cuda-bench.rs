//! Standalone GPU benchmark (same as `veloxquant bench cuda`); see `veloxquant_cuda::bench`.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    std::process::exit(veloxquant_cuda::bench::main_with_args(&args));
}
