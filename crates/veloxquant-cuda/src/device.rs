//! The device: presence checks, context and stream, and the NVRTC module cache.
//!
//! Kernels are CUDA C sources embedded in the binary, specialized by `#define`s and compiled
//! on first use for the device's own compute capability with `--fmad=false` (the CPU never
//! fuses multiply-add in encoders, so codes round identically) and IEEE division and sqrt.
//! Modules are cached per configuration key (family + defines), which is also their name.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{CompileError, CompileOptions};

use crate::error::{drv, CudaError, Result};
use crate::tuning::Tuning;

const COMMON: &str = include_str!("../kernels/common.cuh");

/// Kernel families: one CUDA C file each (plus the headers they share).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Encode,
    Decode,
    Attn,
    /// The device cache's appends and reads (kv.cu), per stream format.
    Kv,
    /// The model's element-wise kernels (model.cu).
    Model,
    /// Prefill attention's band and softmax (prefill.cu).
    Prefill,
}

const ENCODE_ROW: &str = include_str!("../kernels/encode_row.cuh");
const QUERY: &str = include_str!("../kernels/query.cuh");

/// Each GPU format's kernel file (kernels/formats/: its row encoder and decoder, page encoder,
/// decode readers, query preparation and prefill kernels), those a file builds on first. A family's source takes them all at each
/// `// @formats SECTION` line, under `#define SECTION 1`; each file's sections select themselves
/// by the format's defines (KIND, KK, VK). Adding a format to the GPU: one file here, one
/// entry in format.rs.
const FORMATS: [&str; 11] = [
    include_str!("../kernels/formats/fp16.cuh"),
    include_str!("../kernels/formats/q8_0.cuh"),
    include_str!("../kernels/formats/q4_0.cuh"),
    include_str!("../kernels/formats/turboquant_mse.cuh"),
    include_str!("../kernels/formats/qjl.cuh"),
    include_str!("../kernels/formats/turboquant_prod.cuh"),
    include_str!("../kernels/formats/turboquant_rvq.cuh"),
    include_str!("../kernels/formats/rabitq.cuh"),
    include_str!("../kernels/formats/kivi.cuh"),
    include_str!("../kernels/formats/turboquant_frac.cuh"),
    include_str!("../kernels/formats/vecinfer.cuh"),
];

/// `part` with the format files spliced in at its `// @formats SECTION` lines.
fn push_with_formats(src: &mut String, part: &str) {
    for line in part.split_inclusive('\n') {
        match line.trim_end().strip_prefix("// @formats ") {
            Some(section) => {
                src.push_str(&format!("#define {section} 1\n"));
                for f in FORMATS {
                    src.push_str(f);
                }
                src.push_str(&format!("#undef {section}\n"));
            }
            None => src.push_str(line),
        }
    }
}

impl Family {
    pub const ALL: [Family; 6] =
        [Family::Encode, Family::Decode, Family::Attn, Family::Kv, Family::Model, Family::Prefill];

    /// The family's source after the common header.
    pub fn sources(self) -> [&'static str; 2] {
        match self {
            Family::Encode => [ENCODE_ROW, include_str!("../kernels/encode.cu")],
            Family::Decode => ["", include_str!("../kernels/decode.cu")],
            Family::Attn => [QUERY, include_str!("../kernels/attn.cu")],
            Family::Kv => [ENCODE_ROW, include_str!("../kernels/kv.cu")],
            Family::Model => ["", include_str!("../kernels/model.cu")],
            Family::Prefill => [QUERY, include_str!("../kernels/prefill.cu")],
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Family::Encode => "encode",
            Family::Decode => "decode",
            Family::Attn => "attn",
            Family::Kv => "kv",
            Family::Model => "model",
            Family::Prefill => "prefill",
        }
    }
}

/// The module key (and name) of `family` compiled with `defines`.
pub fn module_key(family: Family, defines: &[(&str, i64)]) -> String {
    let mut key = family.name().to_string();
    for (k, v) in defines {
        key.push_str(&format!("_{k}{v}"));
    }
    key
}

/// Compile `family` with `defines` to PTX for `arch` (e.g. "compute_90"): needs libnvrtc
/// only, no device (the CPU-side test compiles every configuration for each target).
pub fn compile_ptx(family: Family, defines: &[(&str, i64)], arch: &'static str) -> Result<cudarc::nvrtc::Ptx> {
    libraries_present_nvrtc()?;
    let key = module_key(family, defines);
    let mut src = String::new();
    for (k, v) in defines {
        src.push_str(&format!("#define {k} {v}\n"));
    }
    src.push_str(COMMON);
    for part in family.sources() {
        push_with_formats(&mut src, part);
    }
    let opts = CompileOptions {
        // Encode must round exactly like the CPU (no contraction); so must the cache's appends.
        fmad: Some(!matches!(family, Family::Encode | Family::Kv)),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        name: Some(format!("{key}.cu")),
        ..Default::default()
    };
    catch_unwind(AssertUnwindSafe(|| cudarc::nvrtc::compile_ptx_with_opts(&src, opts)))
        .map_err(|_| CudaError::CudaUnavailable { lib: "libnvrtc", why: "panicked while compiling".into() })?
        .map_err(|e| CudaError::Nvrtc {
            key,
            log: match e {
                CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => format!("{other:?}"),
            },
        })
}

/// Whether libnvrtc alone can be loaded.
pub fn libraries_present_nvrtc() -> Result<()> {
    // SAFETY: only tries dlopen on the candidate names; no NVRTC call is made.
    let nvrtc = catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false);
    if !nvrtc {
        return Err(CudaError::CudaUnavailable { lib: "libnvrtc", why: "not found by the dynamic loader".into() });
    }
    Ok(())
}

/// The NVRTC target of a compute capability (the kernels need sm_80 or newer: m16n8k16 mma,
/// movmatrix, cp.async; the 2/4-bit decode path and PDL use Hopper's bulk copies and
/// griddepcontrol, so they are tuned and tested on sm_90 only).
pub fn arch_name(cc: (i32, i32)) -> Result<&'static str> {
    Ok(match cc {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => {
            return Err(CudaError::CudaUnavailable {
                lib: "libcuda (driver)",
                why: format!("compute capability {}.{} is not supported (sm_80 or newer)", cc.0, cc.1),
            })
        }
    })
}

pub struct GpuDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub compute_capability: (i32, i32),
    pub sm_count: usize,
    /// Shared memory one block may opt in to (static + dynamic), bytes: the device's, or
    /// `Tuning::smem_limit` where that is smaller.
    pub max_smem_optin: usize,
    pub name: String,
    /// NVRTC target, `compute_{major}{minor}`.
    pub arch: &'static str,
    /// Kernel variants (defaults unless built by `new_with`).
    pub tuning: Tuning,
    /// Where each compiled module's PTX is also written (a development aid for ptxas / SASS).
    pub ptx_dir: Option<std::path::PathBuf>,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuDevice({}, sm_{}{})", self.name, self.compute_capability.0, self.compute_capability.1)
    }
}

/// Whether libcuda and libnvrtc can be loaded (never panics, touches no device).
pub fn libraries_present() -> Result<()> {
    // SAFETY: these only try dlopen on the candidate names; no CUDA call is made.
    let cuda = catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false);
    if !cuda {
        return Err(CudaError::CudaUnavailable {
            lib: "libcuda (driver)",
            why: "not found by the dynamic loader".into(),
        });
    }
    // SAFETY: as above.
    let nvrtc = catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false);
    if !nvrtc {
        return Err(CudaError::CudaUnavailable { lib: "libnvrtc", why: "not found by the dynamic loader".into() });
    }
    Ok(())
}

/// A driver older than `MIN_DRIVER` (its CUDA version, e.g. 13000) is a typed error here rather
/// than a panic at the first missing symbol.
fn check_driver() -> Result<()> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: writes one int through a valid pointer; the symbol exists in every driver.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }.result().map_err(drv("cuDriverGetVersion"))?;
    if v < MIN_DRIVER {
        return Err(CudaError::CudaUnavailable {
            lib: "libcuda (driver)",
            why: format!(
                "driver supports CUDA {}.{}; {}.{} or newer is needed",
                v / 1000,
                v % 1000 / 10,
                MIN_DRIVER / 1000,
                MIN_DRIVER % 1000 / 10
            ),
        });
    }
    Ok(())
}

/// The oldest driver supported: the bindings are CUDA 13's (cudarc `cuda-13000`), and some of
/// the calls made (the batched copies of forks, `cuEventElapsedTime_v2`) are missing from
/// older drivers, where cudarc's loader would panic on the first call instead of failing.
pub const MIN_DRIVER: i32 = 13000;

impl GpuDevice {
    /// Open device `ordinal`; a missing library or device is a typed error, never a panic.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        Self::new_with(ordinal, Tuning::default(), None)
    }

    /// As `new`, with kernel variants and a PTX dump folder (benchmarks).
    pub fn new_with(ordinal: usize, tuning: Tuning, ptx_dir: Option<std::path::PathBuf>) -> Result<Arc<Self>> {
        libraries_present()?;
        check_driver()?;
        let ctx = catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| CudaError::CudaUnavailable {
                lib: "libcuda (driver)",
                why: "panicked while initializing".into(),
            })?
            .map_err(|e| CudaError::CudaUnavailable { lib: "libcuda (driver)", why: format!("{e:?}") })?;
        // SAFETY: we order all work on one stream ourselves; per-slice event tracking only
        // adds events to every launch.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx.compute_capability().map_err(drv("compute_capability"))?;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("attribute"))? as usize;
        let device_smem = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("attribute"))? as usize;
        let max_smem_optin = if tuning.smem_limit > 0 { device_smem.min(tuning.smem_limit) } else { device_smem };
        let name = ctx.name().map_err(drv("name"))?;
        // One created stream for all work (the legacy default stream cannot be captured
        // into a graph, and one stream orders everything without events).
        let stream = ctx.new_stream().map_err(drv("new_stream"))?;
        let arch = arch_name(cc)?;
        Ok(Arc::new(Self {
            ctx,
            stream,
            compute_capability: cc,
            sm_count,
            max_smem_optin,
            name,
            arch,
            tuning: tuning.clamped(),
            ptx_dir,
            modules: Mutex::new(HashMap::new()),
        }))
    }

    /// The function `name` of `family` compiled with `defines`, compiling on first use.
    pub fn function(&self, family: Family, defines: &[(&str, i64)], name: &str) -> Result<CudaFunction> {
        let key = module_key(family, defines);
        let module = {
            let mut cache = self.modules.lock().expect("module cache poisoned");
            match cache.get(&key) {
                Some(m) => m.clone(),
                None => {
                    let m = self.compile(family, defines, &key)?;
                    cache.insert(key.clone(), m.clone());
                    m
                }
            }
        };
        module.load_function(name).map_err(drv("load_function"))
    }

    fn compile(&self, family: Family, defines: &[(&str, i64)], key: &str) -> Result<Arc<CudaModule>> {
        let ptx = compile_ptx(family, defines, self.arch)?;
        if let Some(dir) = &self.ptx_dir {
            let _ = std::fs::write(dir.join(format!("{key}.ptx")), ptx.to_src());
        }
        self.ctx.load_module(ptx).map_err(drv("load_module"))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }
}
