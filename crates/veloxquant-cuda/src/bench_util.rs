//! Device helpers for benchmarks: a hashed N(0,1) f16 generator and a read-bandwidth probe.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use crate::device::{Family, GpuDevice};
use crate::error::{drv, Result};

const UTIL_DEFINES: [(&str, i64); 9] = [
    ("D", 128),
    ("T", 32),
    ("KIND", 0),
    ("BITS", 1),
    ("ROT", 0),
    ("EDEN", 0),
    ("IN_KIND", 1),
    ("ROW_BYTES", 256),
    ("PAGE_BYTES", 8192),
];

fn util(dev: &GpuDevice, name: &str) -> Result<CudaFunction> {
    dev.function(Family::Encode, &UTIL_DEFINES, name)
}

fn grid(dev: &GpuDevice) -> LaunchConfig {
    LaunchConfig { grid_dim: ((dev.sm_count * 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

pub fn fill_normal_f16(dev: &Arc<GpuDevice>, x: &mut CudaSlice<u16>, n: usize, seed: u64) -> Result<()> {
    let f = util(dev, "fill_normal_f16")?;
    let n = n as u64;
    let mut l = dev.stream.launch_builder(&f);
    l.arg(x).arg(&n).arg(&seed);
    // SAFETY: fill_normal_f16(out, n, seed) writes n ≤ x.len() values.
    unsafe { l.launch(grid(dev)) }.map_err(drv("fill_normal_f16"))?;
    Ok(())
}

/// Launch the read probe over the first `n16 * 16` bytes of `buf`.
pub fn read_probe(dev: &Arc<GpuDevice>, buf: &CudaSlice<u8>, n16: usize, sink: &mut CudaSlice<u32>) -> Result<()> {
    let f = util(dev, "read_probe")?;
    let n = n16 as u64;
    let mut l = dev.stream.launch_builder(&f);
    l.arg(buf).arg(&n).arg(sink);
    // SAFETY: read_probe(p, n, out) reads n 16-byte vectors of buf (16-byte aligned alloc).
    unsafe { l.launch(grid(dev)) }.map_err(drv("read_probe"))?;
    Ok(())
}
