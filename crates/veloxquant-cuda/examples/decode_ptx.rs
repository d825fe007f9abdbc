//! Writes the PTX of the decode modules a plan for KEYS/VALUES at head size D and group G
//! compiles on a given target, for reading the SASS offline (`ptxas` + `cuobjdump -sass`).
//! Needs libnvrtc only (no GPU).
//! Usage: decode_ptx KEYS VALUES D G CC_MAJOR CC_MINOR OUT_DIR
use veloxquant::format::{FormatSpec, Stream};
use veloxquant_cuda::device::{arch_name, compile_ptx};
use veloxquant_cuda::GpuFormat;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 7 {
        return Err("usage: decode_ptx KEYS VALUES D G CC_MAJOR CC_MINOR OUT_DIR".into());
    }
    let (d, g): (usize, usize) = (a[2].parse()?, a[3].parse()?);
    let cc: (i32, i32) = (a[4].parse()?, a[5].parse()?);
    let kf = GpuFormat::for_stream(&FormatSpec::parse(&a[0])?, d, 32, 1, Stream::Keys)?;
    let vf = GpuFormat::for_stream(&FormatSpec::parse(&a[1])?, d, 32, 1, Stream::Values)?;
    let arch = arch_name(cc)?;
    for (i, (fam, defs)) in veloxquant_cuda::attn::decode_modules(&kf, &vf, g, cc).into_iter().enumerate() {
        let d: Vec<(&str, i64)> = defs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let ptx = compile_ptx(fam, &d, arch)?;
        let path = std::path::Path::new(&a[6]).join(format!("{}-{i}.ptx", fam.name()));
        std::fs::write(&path, ptx.to_src())?;
        println!("{}: {:?}", path.display(), defs);
    }
    Ok(())
}
