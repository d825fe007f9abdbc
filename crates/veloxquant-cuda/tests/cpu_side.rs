//! CPU-side checks that run everywhere (no GPU needed).

use veloxquant::format::{FormatCtx, FormatSpec, Stream};
use veloxquant_cuda::{libraries_present, GpuDevice, GpuFormat};

#[test]
fn gpu_layouts_match_cpu_page_sizes() {
    for s in [
        "fp16",
        "q8_0",
        "q4_0:rot",
        "turboquant_mse:1",
        "turboquant_mse:2",
        "turboquant_mse:3:eden",
        "turboquant_mse:4",
    ] {
        let spec = FormatSpec::parse(s).unwrap();
        for d in [64, 128] {
            let cpu = spec.build(&FormatCtx::new(d, 32, Stream::Values, 9)).unwrap();
            let g = GpuFormat::new(&spec, d, 32, 9).unwrap();
            assert_eq!(g.page_bytes, cpu.page_bytes(), "{s} d={d}");
            assert!((g.bits_per_value() - cpu.bits_per_value()).abs() < 1e-12);
        }
    }
    assert!(GpuFormat::new(&FormatSpec::parse("fp16").unwrap(), 96, 32, 1).is_err());
}

#[test]
fn missing_cuda_is_an_error_not_a_panic() {
    // Either outcome is fine; what matters is that neither call panics.
    let present = libraries_present();
    match GpuDevice::new(0) {
        Ok(d) => eprintln!("GPU present: {d:?}"),
        Err(e) => eprintln!("no GPU (expected on CI): {e}; libraries: {present:?}"),
    }
}
